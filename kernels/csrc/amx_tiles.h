// AMX tiles for the kernels that multiply on them (linear_amx.cpp, the decode attention's tile path): whether this
// build has them, the one tile configuration they share and the process's permission to use the tile registers.
//
// RADIXRT_AMX is defined where the build targets a CPU with AMX-BF16 and AVX512-BF16 (-march=native there). Every
// tile is configured as 16 rows of 64 bytes: an A tile 16 rows of 32 bf16, a B tile 16 pairs of k by 16 columns,
// an accumulator 16 rows of 16 fp32. Linux hands out the tile registers only on request (arch_prctl), once per
// process; tiles_permitted() asks and remembers the answer.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
#define RADIXRT_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace radixrt::amx {

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline TileConfig tile_config() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  return cfg;
}

inline bool tiles_permitted() {
  static const bool granted = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

// Loads the shared configuration in this thread for its lifetime in scope, and releases the tiles after.
struct TileScope {
  TileScope() {
    const TileConfig cfg = tile_config();
    _tile_loadconfig(&cfg);
  }
  ~TileScope() { _tile_release(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

}  // namespace radixrt::amx
#endif
