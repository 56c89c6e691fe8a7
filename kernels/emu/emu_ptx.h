// Host definitions of the PTX helpers of kernels/cuda/peer_transport.cuh, with the same
// meaning on the emulated GPU. Included by that header inside namespace jax_ep::peer.
//   signal        release store: drains this thread's pending peer stores first
//   load_acquire  a poll: the scheduler may run other threads before it reads
//   load_cg*      plain reads of what has become visible (drained)
//   load_nc16     the same, except that peer memory read twice may return the first read
//                 (emu::load_nc: the non-coherent path)
//   store*        peer stores (store16_na too: L1 allocation is no visibility rule):
//                 buffered per thread until a fence or release drains them
// Each counts its bytes by width and space (emu::note_access, via store_bytes for stores).
//   global_timer  the virtual clock
//   sync_threads  a named barrier (bar.sync id, threads)
//   bulk_*, mbar_*  bulk copies (TMA): land at the waits (emu_cuda.h, "Bulk asynchronous
//                 copies"), checked for alignment and mbarrier accounting
//   fence_bulk_*  proxy fences: without them a bulk copy reads stale bytes in some seeds

inline void signal(uint64_t* flag, uint64_t value) { ::emu::release_store64(flag, value); }

inline uint64_t load_acquire(const uint64_t* flag) {
  ::emu::note_acquire_at(flag, -1);
  return *reinterpret_cast<const volatile uint64_t*>(flag);
}

inline uint64_t global_timer_ns() { return ::emu::global_timer_ns(); }

inline uint4 load_cg16(const void* p) {
  ::emu::note_access(::emu::kAccessLoad, p, 16, 1);
  uint4 v;
  std::memcpy(&v, p, 16);
  return v;
}
inline uint4 load_nc16(const void* p) {
  ::emu::note_access(::emu::kAccessLoad, p, 16, 1);
  uint4 v;
  ::emu::load_nc(&v, p, 16);
  return v;
}
inline uint32_t load_cg4(const void* p) {
  ::emu::note_access(::emu::kAccessLoad, p, 4, 1);
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline unsigned lanemask_lt() { return (1u << ::emu::g_ctx->lane) - 1u; }

inline void sync_threads(int id, int threads) { ::emu::named_barrier(id, threads); }

template <typename T>
inline void store(T* p, T v) {
  ::emu::store_bytes(p, &v, sizeof(T));
}
inline void store16(void* p, uint4 v) { ::emu::store_bytes(p, &v, 16); }
inline void store16_na(void* p, uint4 v) { ::emu::store_bytes(p, &v, 16); }
template <typename T>
inline void store_volatile(T* p, T v) {
  ::emu::store_bytes(p, &v, sizeof(T));
}

inline void mbar_init(uint64_t* mbar) { ::emu::mbar_init(mbar, 1); }
inline void fence_bulk_shared() { ::emu::proxy_fence(::emu::kProxyShared); }
inline void fence_bulk_global() { ::emu::proxy_fence(::emu::kProxyGlobal); }
inline void mbar_arrive_expect_tx(uint64_t* mbar, uint32_t bytes) {
  ::emu::mbar_arrive_expect_tx(mbar, bytes);
}
inline void bulk_load_tx(void* smem, const void* src, uint32_t n, uint64_t* mbar) {
  ::emu::bulk_load_tx(smem, src, n, mbar);
}
inline bool mbar_wait(uint64_t* mbar, uint32_t parity, int64_t timeout_ns) {
  return ::emu::mbar_wait(mbar, parity, timeout_ns);
}
inline void bulk_store(void* dst, const void* smem, uint32_t n) { ::emu::bulk_store(dst, smem, n); }
inline void bulk_commit() { ::emu::bulk_commit(); }
template <int keep>
inline void bulk_wait_read() {
  ::emu::bulk_wait(keep);
}
inline void bulk_wait_all() {
  ::emu::bulk_wait(0);
  ::emu::proxy_fence(::emu::kProxyGlobal);
}
