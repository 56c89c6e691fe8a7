// Emulated-GPU replacement for the CUDA header of the same name (kernels/emu/README.md).
#pragma once
#include "kernels/emu/emu_cuda.h"
