// Run-time instruction paths of the avx512 build beyond AVX-512 F/BW/VL/VNNI: AVX-512 BF16 (vdpbf16ps) and
// AMX (tile registers, tdpbssd / tdpbf16ps). Each is used only where the CPU has it, the kernel asked and
// got the OS's permission (AMX tile data is an XSAVE feature Linux enables per process on request), and
// the path limit allows it. The limit lets tests and benchmarks force every narrower path on a machine
// that has the wider ones: 2 = all the CPU has, 1 = no AMX, 0 = neither (plain zmm). Included by
// moe_cpu.cpp before the zmm headers.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace moegate {

enum PathLevel : int { kPlainZmm = 0, kBf16Dot = 1, kAmx = 2 };

inline std::atomic<int>& path_limit() {
  static std::atomic<int> limit{kAmx};
  return limit;
}

inline bool path_allowed(PathLevel level) { return path_limit().load(std::memory_order_relaxed) >= level; }

// AMX-TILE, AMX-INT8 and AMX-BF16 reported by CPUID leaf 7 (EDX bits 24, 25, 22) and the tile data
// permission granted (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 18). Asked once per process.
struct AmxSupport {
  bool int8 = false;
  bool bf16 = false;
};

inline AmxSupport detect_amx() {
  AmxSupport s;
#if defined(__x86_64__) && defined(__linux__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1u)) return s;
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
  if (syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) != 0) return s;
  s.int8 = (d >> 25) & 1u;
  s.bf16 = (d >> 22) & 1u;
#endif
  return s;
}

inline const AmxSupport& amx_support() {
  static const AmxSupport s = detect_amx();
  return s;
}

inline bool amx_int8_here() { return amx_support().int8 && path_allowed(kAmx); }
inline bool amx_bf16_here() { return amx_support().bf16 && path_allowed(kAmx); }

// One AMX tile configuration (palette 1): rows and bytes per row of tiles 0..7. A thread loads a
// configuration only when it differs from the one it loaded last (ldtilecfg is not free); callers
// describe their tiles and call configure() before their first tile instruction.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  void set(int tile, int nrows, int bytes_per_row) {
    rows[tile] = (uint8_t)nrows;
    colsb[tile] = (uint16_t)bytes_per_row;
  }
};
static_assert(sizeof(TileConfig) == 64, "ldtilecfg reads 64 bytes");

// (inline asm: the assembler knows the instructions whatever the compiler flags; the tile kernels carry
// their own target attributes.)
#if defined(__x86_64__)
struct LoadedTiles {
  TileConfig cfg{};
  bool any = false;
};
inline LoadedTiles& loaded_tiles() {
  thread_local LoadedTiles t;
  return t;
}

inline void configure_tiles(const TileConfig& cfg) {
  LoadedTiles& t = loaded_tiles();
  if (t.any && std::memcmp(&t.cfg, &cfg, sizeof cfg) == 0) return;
  asm volatile("ldtilecfg %0" : : "m"(cfg));
  t.cfg = cfg;
  t.any = true;
}

// tilerelease (back to the init state, so the OS need not save tile data on a switch) and forget the
// loaded configuration.
inline void release_tiles() {
  LoadedTiles& t = loaded_tiles();
  if (!t.any) return;
  asm volatile("tilerelease" : : : "memory");
  t.any = false;
}
#endif

}  // namespace moegate
