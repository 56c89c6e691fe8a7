// Per-QP LAG TX port affinity and RoCE UDP source port for NVSHMEM's IBGDA RC QPs.
//
// NVSHMEM 3.8's IBGDA transport (nvshmem_transport_ibgda.so) links libmlx5.so.1 and
// creates and moves its RC QPs with mlx5dv_devx_obj_create / mlx5dv_devx_obj_modify PRM
// commands. This small library defines those two symbols (version MLX5_1.7, as the
// transport binds them); jax_ep loads it with RTLD_GLOBAL before NVSHMEM starts, so the
// transport's calls come here first. Every call is forwarded to the real libmlx5; while
// jax_ep_lag_configure has enabled it:
//   - each RC QP created (CREATE_QP with qpc.st == RC) is numbered k = 0, 1, ... and
//     gets member affinity (k / group) % members + 1 and UDP source port sport_base + k;
//   - RST2INIT carries the affinity in its qpc, INIT2RTR the UDP source port in its
//     primary address path (and, if init2rtr_affinity, the affinity with its mask bit);
//   - after a successful RTR2RTS the shim issues RTS2RTS with the affinity (and the
//     mask bit), which some firmware needs to honour it; its status is recorded;
//   - each RC QP's device (ibv_get_device_name of the context it was created on) is
//     recorded, so the QP -> device table is what NVSHMEM did, not a model of it.
// members == 0 and sport_base == 0 only record.
// jax_ep_lag_table returns what was done per QP. The field offsets are those of
// jax_ep/network/lag_affinity.py (tests compare both on synthetic PRM buffers).
#include <dlfcn.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <vector>

namespace {

constexpr uint32_t kOpCreateQp = 0x500;
constexpr uint32_t kOpRst2Init = 0x502;
constexpr uint32_t kOpInit2Rtr = 0x503;
constexpr uint32_t kOpRtr2Rts = 0x504;
constexpr uint32_t kOpRts2Rts = 0x505;

// bit offsets (big-endian numbering) in a QP command and in its qpc
constexpr size_t kOpcodeBit = 0x00;
constexpr size_t kQpnBit = 0x48;
constexpr size_t kOptMaskBit = 0x80;
constexpr size_t kQpcBit = 0xC0;
constexpr size_t kQpcBits = 0x740;
constexpr size_t kOptMask9532Bit = 0x840;
constexpr size_t kCmdBytes = 0x880 / 8;
constexpr size_t kLagAffBit = 0x4;            // in qpc
constexpr size_t kStBit = 0x8;                // in qpc: service type, RC = 0
constexpr size_t kUdpSportBit = 0xC0 + 0x110;  // in qpc: primary_address_path.udp_sport
constexpr size_t kOutQpnBit = 0x48;           // in create_qp_out
constexpr uint32_t kOptLagTxAff = 1u << 15;
constexpr uint64_t kOpt32UdpSport = 1u << 2;

uint64_t GetBits(const uint8_t* buf, size_t bit, size_t width) {
  uint64_t v = 0;
  for (size_t i = 0; i < width; ++i) {
    size_t b = bit + i;
    v = (v << 1) | ((buf[b / 8] >> (7 - b % 8)) & 1u);
  }
  return v;
}

void SetBits(uint8_t* buf, size_t bit, size_t width, uint64_t value) {
  for (size_t i = 0; i < width; ++i) {
    size_t b = bit + i;
    uint8_t m = static_cast<uint8_t>(1u << (7 - b % 8));
    if ((value >> (width - 1 - i)) & 1u) {
      buf[b / 8] |= m;
    } else {
      buf[b / 8] &= static_cast<uint8_t>(~m);
    }
  }
}

struct QpRecord {
  void* obj;
  void* context;
  char device[64];
  uint32_t qpn;
  int affinity;
  int sport;
  int patched;        // bit 0: affinity in RST2INIT, bit 1: sport in INIT2RTR, bit 2: INIT2RTR aff
  int rts2rts_status;  // -1 not issued, else the modify's return code (0 = ok)
};

struct Config {
  bool enabled = false;
  int members = 0;  // 0: no affinity
  int group = 1;
  int sport_base = 0;  // 0: leave the UDP source port alone
  bool init2rtr_affinity = false;
};

using CreateFn = void* (*)(void*, const void*, size_t, void*, size_t);
using ModifyFn = int (*)(void*, const void*, size_t, void*, size_t);

std::recursive_mutex g_mu;  // recursive: libmlx5 may call itself through these names
Config g_cfg;
std::vector<QpRecord> g_qps;
CreateFn g_create = nullptr;
ModifyFn g_modify = nullptr;

bool Resolve() {
  if (g_create != nullptr && g_modify != nullptr) return true;
  void* h = dlopen("libmlx5.so.1", RTLD_NOW | RTLD_LOCAL);
  if (h == nullptr) return false;
  void* c = dlvsym(h, "mlx5dv_devx_obj_create", "MLX5_1.7");
  void* m = dlvsym(h, "mlx5dv_devx_obj_modify", "MLX5_1.7");
  if (c == nullptr) c = dlsym(h, "mlx5dv_devx_obj_create");
  if (m == nullptr) m = dlsym(h, "mlx5dv_devx_obj_modify");
  g_create = reinterpret_cast<CreateFn>(c);
  g_modify = reinterpret_cast<ModifyFn>(m);
  return g_create != nullptr && g_modify != nullptr;
}

// The RDMA device name of a verbs context, or "ctx:<address>" where libibverbs is not
// loaded (the context's first member is its ibv_device).
void DeviceName(void* context, char* out, size_t cap) {
  using NameFn = const char* (*)(void*);
  static NameFn name_fn = nullptr;
  static bool looked = false;
  if (!looked) {
    looked = true;
    void* h = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (h != nullptr) name_fn = reinterpret_cast<NameFn>(dlsym(h, "ibv_get_device_name"));
  }
  const char* name = nullptr;
  if (name_fn != nullptr && context != nullptr) {
    void* device = *static_cast<void**>(context);
    if (device != nullptr) name = name_fn(device);
  }
  if (name != nullptr) {
    std::snprintf(out, cap, "%s", name);
  } else {
    std::snprintf(out, cap, "ctx:%p", context);
  }
}

QpRecord* Find(void* obj) {
  for (auto& r : g_qps) {
    if (r.obj == obj) return &r;
  }
  return nullptr;
}

}  // namespace

extern "C" {

// Changes a QP modify command in place as the shim does before forwarding it.
// Returns the fields changed: 1 affinity (RST2INIT), 2 UDP sport (INIT2RTR),
// 4 affinity with its mask bit (INIT2RTR).
__attribute__((visibility("default"))) int jax_ep_lag_patch(uint8_t* cmd, size_t len,
                                                            int affinity, int sport,
                                                            int init2rtr_affinity) {
  if (cmd == nullptr || len * 8 < kQpcBit + kQpcBits) return 0;
  uint32_t op = static_cast<uint32_t>(GetBits(cmd, kOpcodeBit, 16));
  int changed = 0;
  if (op == kOpRst2Init && affinity > 0 && affinity < 16) {
    SetBits(cmd, kQpcBit + kLagAffBit, 4, static_cast<uint64_t>(affinity));
    changed |= 1;
  } else if (op == kOpInit2Rtr) {
    if (sport >= 0xC000 && sport <= 0xFFFF) {
      SetBits(cmd, kQpcBit + kUdpSportBit, 16, static_cast<uint64_t>(sport));
      changed |= 2;
    }
    if (init2rtr_affinity && affinity > 0 && affinity < 16) {
      SetBits(cmd, kQpcBit + kLagAffBit, 4, static_cast<uint64_t>(affinity));
      SetBits(cmd, kOptMaskBit, 32, GetBits(cmd, kOptMaskBit, 32) | kOptLagTxAff);
      changed |= 4;
    }
  }
  return changed;
}

// Builds an RTS2RTS modify setting the affinity (if > 0) and/or UDP sport (if >= 0xC000).
// Returns its length, or 0 if `cap` is too small or nothing is to be set.
__attribute__((visibility("default"))) size_t jax_ep_lag_rts2rts(uint8_t* out, size_t cap,
                                                                 uint32_t qpn, int affinity,
                                                                 int sport) {
  bool aff = affinity > 0 && affinity < 16;
  bool sp = sport >= 0xC000 && sport <= 0xFFFF;
  if (out == nullptr || cap < kCmdBytes || (!aff && !sp) || qpn >= (1u << 24)) return 0;
  std::memset(out, 0, kCmdBytes);
  SetBits(out, kOpcodeBit, 16, kOpRts2Rts);
  SetBits(out, kQpnBit, 24, qpn);
  if (aff) {
    SetBits(out, kQpcBit + kLagAffBit, 4, static_cast<uint64_t>(affinity));
    SetBits(out, kOptMaskBit, 32, kOptLagTxAff);
  }
  if (sp) {
    SetBits(out, kQpcBit + kUdpSportBit, 16, static_cast<uint64_t>(sport));
    SetBits(out, kOptMask9532Bit, 64, kOpt32UdpSport);
  }
  return kCmdBytes;
}

// Enables the shim for the RC QPs created from now on (members 0: no affinity;
// sport_base 0: UDP source port unchanged) and forgets earlier records.
__attribute__((visibility("default"))) int jax_ep_lag_configure(int members, int group,
                                                                int sport_base,
                                                                int init2rtr_affinity) {
  if (members < 0 || members > 15 || group < 1 ||
      (sport_base != 0 && (sport_base < 0xC000 || sport_base > 0xFFFF))) {
    return -1;
  }
  std::lock_guard<std::recursive_mutex> lock(g_mu);
  g_cfg.enabled = true;
  g_cfg.members = members;
  g_cfg.group = group;
  g_cfg.sport_base = sport_base;
  g_cfg.init2rtr_affinity = init2rtr_affinity != 0;
  g_qps.clear();
  return 0;
}

__attribute__((visibility("default"))) void jax_ep_lag_disable() {
  std::lock_guard<std::recursive_mutex> lock(g_mu);
  g_cfg.enabled = false;
}

// Copies up to `max` records (creation order); returns how many RC QPs were seen.
__attribute__((visibility("default"))) int jax_ep_lag_table(uint32_t* qpn, int32_t* affinity,
                                                            int32_t* sport, int32_t* patched,
                                                            int32_t* rts2rts_status, int max) {
  std::lock_guard<std::recursive_mutex> lock(g_mu);
  int n = static_cast<int>(g_qps.size());
  for (int i = 0; i < n && i < max; ++i) {
    const QpRecord& r = g_qps[static_cast<size_t>(i)];
    if (qpn) qpn[i] = r.qpn;
    if (affinity) affinity[i] = r.affinity;
    if (sport) sport[i] = r.sport;
    if (patched) patched[i] = r.patched;
    if (rts2rts_status) rts2rts_status[i] = r.rts2rts_status;
  }
  return n;
}

// Copies the device name of record `i` into `buf` (NUL-terminated); returns its length,
// or -1 if there is no such record.
__attribute__((visibility("default"))) int jax_ep_lag_device(int i, char* buf, int cap) {
  std::lock_guard<std::recursive_mutex> lock(g_mu);
  if (i < 0 || i >= static_cast<int>(g_qps.size()) || buf == nullptr || cap < 1) return -1;
  std::snprintf(buf, static_cast<size_t>(cap), "%s", g_qps[static_cast<size_t>(i)].device);
  return static_cast<int>(std::strlen(buf));
}

// 1 when the real libmlx5 entry points were found (0 before the first call or without it).
__attribute__((visibility("default"))) int jax_ep_lag_resolved() {
  std::lock_guard<std::recursive_mutex> lock(g_mu);
  return Resolve() ? 1 : 0;
}

__attribute__((visibility("default"))) void* mlx5dv_devx_obj_create(void* context,
                                                                    const void* in,
                                                                    size_t inlen, void* out,
                                                                    size_t outlen) {
  std::lock_guard<std::recursive_mutex> lock(g_mu);
  if (!Resolve()) return nullptr;
  void* obj = g_create(context, in, inlen, out, outlen);
  const uint8_t* cmd = static_cast<const uint8_t*>(in);
  if (obj != nullptr && g_cfg.enabled && cmd != nullptr && inlen * 8 >= kQpcBit + kQpcBits &&
      GetBits(cmd, kOpcodeBit, 16) == kOpCreateQp && GetBits(cmd, kQpcBit + kStBit, 8) == 0 &&
      out != nullptr && outlen * 8 >= kOutQpnBit + 24) {
    int k = static_cast<int>(g_qps.size());
    QpRecord r{};
    r.obj = obj;
    r.context = context;
    DeviceName(context, r.device, sizeof(r.device));
    r.qpn = static_cast<uint32_t>(GetBits(static_cast<const uint8_t*>(out), kOutQpnBit, 24));
    r.affinity = g_cfg.members > 0 ? (k / g_cfg.group) % g_cfg.members + 1 : 0;
    r.sport = g_cfg.sport_base != 0 ? 0xC000 + (g_cfg.sport_base - 0xC000 + k) % 0x4000 : 0;
    r.patched = 0;
    r.rts2rts_status = -1;
    g_qps.push_back(r);
  }
  return obj;
}

__attribute__((visibility("default"))) int mlx5dv_devx_obj_modify(void* obj, const void* in,
                                                                 size_t inlen, void* out,
                                                                 size_t outlen) {
  std::lock_guard<std::recursive_mutex> lock(g_mu);
  if (!Resolve()) return -1;
  QpRecord* r = g_cfg.enabled ? Find(obj) : nullptr;
  const uint8_t* cmd = static_cast<const uint8_t*>(in);
  if (r == nullptr || cmd == nullptr || inlen * 8 < kQpcBit + kQpcBits) {
    return g_modify(obj, in, inlen, out, outlen);
  }
  std::vector<uint8_t> copy(cmd, cmd + inlen);
  r->patched |= jax_ep_lag_patch(copy.data(), copy.size(), r->affinity, r->sport,
                                 g_cfg.init2rtr_affinity ? 1 : 0);
  int ret = g_modify(obj, copy.data(), copy.size(), out, outlen);
  if (ret == 0 && GetBits(cmd, kOpcodeBit, 16) == kOpRtr2Rts && r->affinity > 0) {
    uint8_t again[kCmdBytes];
    uint8_t again_out[16] = {};
    size_t n = jax_ep_lag_rts2rts(again, sizeof(again), r->qpn, r->affinity, 0);
    r->rts2rts_status = n ? g_modify(obj, again, n, again_out, sizeof(again_out)) : -1;
  }
  return ret;
}

}  // extern "C"
