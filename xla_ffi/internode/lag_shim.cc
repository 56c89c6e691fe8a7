// Per-QP LAG TX port affinity and RoCE UDP source port for NVSHMEM's IBGDA RC QPs.
//
// NVSHMEM 3.8's IBGDA transport (nvshmem_transport_ibgda.so) links libmlx5.so.1 and
// creates and moves its RC QPs with mlx5dv_devx_obj_create / mlx5dv_devx_obj_modify PRM
// commands. This small library defines those two symbols (version MLX5_1.7, as the
// transport binds them); jax_ep loads it with RTLD_GLOBAL before NVSHMEM starts, so the
// transport's calls come here first. Every call is forwarded to the real libmlx5.
//
// Where the affinity may go. RST2INIT carries the whole QPC, so lag_tx_port_affinity is
// taken there with no opt_param bit: the Linux driver (drivers/infiniband/hw/mlx5/qp.c,
// __mlx5_ib_modify_qp / get_tx_affinity) writes it into the QPC at RST2INIT. After that
// the field changes only as an optional parameter, opt_param_mask bit 15
// (MLX5_QP_OPTPAR_LAG_TX_AFF): rdma-core's mlx5dv_modify_qp_lag_port sends it with
// RTS2RTS, and the driver sends it with INIT2RTR only when the device reports the HCA
// capability init2_lag_tx_port_affinity. The shim cannot read that capability, and a
// device without it answers bad_param, which NVSHMEM turns into an aborted job: so the
// shim never touches an INIT2RTR's affinity or its bit 15, and uses only RST2INIT's
// QPC and an RTS2RTS of its own once the QP is in RTS.
//
// What it does, and only inside an armed window (jax_ep_lag_arm .. jax_ep_lag_disarm,
// opened around NVSHMEM's initialisation) and only for QPs on the configured devices
// (jax_ep_lag_devices; none configured: any device), so other libraries' QPs are left
// as they were sent:
//   - each RC QP created (CREATE_QP with qpc.st == RC) is numbered k = 0, 1, ... and
//     gets member affinity (k / group) % members + 1 and UDP source port sport_base + k;
//   - RST2INIT carries the affinity in its qpc, INIT2RTR the UDP source port in its
//     primary address path (a mandatory field there, so no mask bit);
//   - after a successful RTR2RTS the shim issues RTS2RTS with the affinity and bit 15,
//     which some firmware needs to honour it; its status is recorded;
//   - a command the device refuses with the shim's change is sent again as NVSHMEM
//     wrote it, so NVSHMEM's transition never fails because of the shim, and the refusal
//     is recorded; a refused RTS2RTS (the shim's own command) is recorded, nothing more;
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
#include <string>
#include <vector>

#include "xla_ffi/internode/lag_rule.h"

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
constexpr uint32_t kOptLagTxAff = 1u << 15;   // RTS2RTS only (see the top of this file)
constexpr uint64_t kOpt32UdpSport = 1u << 2;

// QpRecord::patched bits; jax_ep/network/lag_affinity.py names the same values.
constexpr int kAffRst2Init = 1;       // affinity in RST2INIT's qpc, accepted
constexpr int kSportInit2Rtr = 2;     // UDP source port in INIT2RTR, accepted
constexpr int kAffRts2Rts = 4;        // the shim's RTS2RTS with the affinity, accepted
constexpr int kAffRst2InitRefused = 8;   // RST2INIT refused with it; sent as NVSHMEM wrote it
constexpr int kSportRefused = 16;        // INIT2RTR refused with it; sent as NVSHMEM wrote it

constexpr size_t kMaxDevices = 16;
constexpr size_t kDeviceChars = 64;

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
  void* obj;  // nullptr once the address was handed out again for a newer object
  void* context;
  char device[kDeviceChars];
  uint32_t qpn;
  int affinity;
  int sport;
  int patched;         // kAffRst2Init | kSportInit2Rtr | kAffRts2Rts | ...Refused
  int rts2rts_status;  // -1 not issued, else the modify's return code (0 = ok)
};

struct Config {
  bool armed = false;
  int members = 0;  // 0: no affinity
  int group = 1;
  int sport_base = 0;  // 0: leave the UDP source port alone
  std::vector<std::string> devices;  // empty: every device
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

// A device filter names devices, so a context whose name libibverbs cannot give
// ("ctx:...") never matches one: unknown QPs stay untouched.
bool DeviceWanted(const char* device) {
  if (g_cfg.devices.empty()) return true;
  for (const auto& d : g_cfg.devices) {
    if (d == device) return true;
  }
  return false;
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
// Returns the fields changed: 1 affinity (RST2INIT's qpc), 2 UDP sport (INIT2RTR).
// An INIT2RTR's affinity and opt_param_mask are never changed.
__attribute__((visibility("default"))) int jax_ep_lag_patch(uint8_t* cmd, size_t len,
                                                            int affinity, int sport) {
  if (cmd == nullptr || len * 8 < kQpcBit + kQpcBits) return 0;
  uint32_t op = static_cast<uint32_t>(GetBits(cmd, kOpcodeBit, 16));
  if (op == kOpRst2Init && affinity > 0 && affinity < 16) {
    SetBits(cmd, kQpcBit + kLagAffBit, 4, static_cast<uint64_t>(affinity));
    return kAffRst2Init;
  }
  if (op == kOpInit2Rtr && sport >= 0xC000 && sport <= 0xFFFF) {
    SetBits(cmd, kQpcBit + kUdpSportBit, 16, static_cast<uint64_t>(sport));
    return kSportInit2Rtr;
  }
  return 0;
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

// Sets what the next armed window does to the RC QPs created in it (members 0: no
// affinity; sport_base 0: UDP source port unchanged) and forgets earlier records.
// It does not arm.
__attribute__((visibility("default"))) int jax_ep_lag_configure(int members, int group,
                                                                int sport_base) {
  if (members < 0 || members > 15 || group < 1 ||
      (sport_base != 0 && (sport_base < 0xC000 || sport_base > 0xFFFF))) {
    return -1;
  }
  std::lock_guard<std::recursive_mutex> lock(g_mu);
  g_cfg.members = members;
  g_cfg.group = group;
  g_cfg.sport_base = sport_base;
  g_qps.clear();
  return 0;
}

// The devices whose QPs the shim takes, comma-separated ("" or nullptr: every device).
__attribute__((visibility("default"))) int jax_ep_lag_devices(const char* csv) {
  std::vector<std::string> names;
  if (csv != nullptr) {
    std::string s(csv);
    size_t start = 0;
    while (start <= s.size()) {
      size_t end = s.find(',', start);
      if (end == std::string::npos) end = s.size();
      if (end > start) {
        if (end - start >= kDeviceChars) return -1;
        names.push_back(s.substr(start, end - start));
      }
      start = end + 1;
    }
  }
  if (names.size() > kMaxDevices) return -1;
  std::lock_guard<std::recursive_mutex> lock(g_mu);
  g_cfg.devices = names;
  return 0;
}

__attribute__((visibility("default"))) void jax_ep_lag_arm() {
  std::lock_guard<std::recursive_mutex> lock(g_mu);
  g_cfg.armed = true;
}

__attribute__((visibility("default"))) void jax_ep_lag_disarm() {
  std::lock_guard<std::recursive_mutex> lock(g_mu);
  g_cfg.armed = false;
}

__attribute__((visibility("default"))) int jax_ep_lag_armed() {
  std::lock_guard<std::recursive_mutex> lock(g_mu);
  return g_cfg.armed ? 1 : 0;
}

// Copies up to `max` records (creation order); returns how many RC QPs were taken.
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
  if (obj == nullptr) return obj;
  // libmlx5 frees destroyed objects without passing through here, so an address may
  // come back for an unrelated object: the old record must not claim it.
  for (auto& old : g_qps) {
    if (old.obj == obj) old.obj = nullptr;
  }
  const uint8_t* cmd = static_cast<const uint8_t*>(in);
  if (g_cfg.armed && cmd != nullptr && inlen * 8 >= kQpcBit + kQpcBits &&
      GetBits(cmd, kOpcodeBit, 16) == kOpCreateQp && GetBits(cmd, kQpcBit + kStBit, 8) == 0 &&
      out != nullptr && outlen * 8 >= kOutQpnBit + 24) {
    QpRecord r{};
    DeviceName(context, r.device, sizeof(r.device));
    if (!DeviceWanted(r.device)) return obj;
    int k = static_cast<int>(g_qps.size());
    r.obj = obj;
    r.context = context;
    r.qpn = static_cast<uint32_t>(GetBits(static_cast<const uint8_t*>(out), kOutQpnBit, 24));
    r.affinity = jax_ep::lag_rule::Affinity(k, g_cfg.group, g_cfg.members);
    r.sport = jax_ep::lag_rule::SourcePort(k, g_cfg.sport_base);
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
  QpRecord* r = g_cfg.armed ? Find(obj) : nullptr;
  const uint8_t* cmd = static_cast<const uint8_t*>(in);
  if (r == nullptr || cmd == nullptr || inlen * 8 < kQpcBit + kQpcBits) {
    return g_modify(obj, in, inlen, out, outlen);
  }
  std::vector<uint8_t> copy(cmd, cmd + inlen);
  int changed = jax_ep_lag_patch(copy.data(), copy.size(), r->affinity, r->sport);
  int ret;
  if (changed == 0) {
    ret = g_modify(obj, in, inlen, out, outlen);
  } else {
    ret = g_modify(obj, copy.data(), copy.size(), out, outlen);
    if (ret == 0) {
      r->patched |= changed;
    } else {
      // A refused modify leaves the QP where it was, so NVSHMEM's own command can still
      // be sent; only if that one succeeds was the refusal about the shim's field.
      ret = g_modify(obj, in, inlen, out, outlen);
      if (ret == 0) r->patched |= changed == kAffRst2Init ? kAffRst2InitRefused : kSportRefused;
    }
  }
  if (ret == 0 && GetBits(cmd, kOpcodeBit, 16) == kOpRtr2Rts && r->affinity > 0) {
    uint8_t again[kCmdBytes];
    uint8_t again_out[16] = {};
    size_t n = jax_ep_lag_rts2rts(again, sizeof(again), r->qpn, r->affinity, 0);
    // Its failure is recorded, never returned: the RTR2RTS NVSHMEM asked for succeeded.
    r->rts2rts_status = n ? g_modify(obj, again, n, again_out, sizeof(again_out)) : -1;
    if (r->rts2rts_status == 0) r->patched |= kAffRts2Rts;
  }
  return ret;
}

}  // extern "C"
