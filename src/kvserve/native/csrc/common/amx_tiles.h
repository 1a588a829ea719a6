/*
 * AMX set-up shared by the kernels that use tiles (attention/prefill_bf16.c,
 * attention/decode_amx.h, linear/linear_amx.c): the OS permission, and one tile configuration,
 * every tile 16 rows of 64 bytes (16 x 32 bf16 operands, 16 x 16 float32 accumulators).  A
 * kernel configures the tiles in each of its threads and releases them at its end: SDPA's flash
 * kernel and oneDNN configure their own before use (tests/unit/test_bf16_prefill.py
 * interleaves them).
 * Include after <immintrin.h>, where __AMX_TILE__ is defined, on Linux.
 */
#ifndef KVSERVE_AMX_TILES_H
#define KVSERVE_AMX_TILES_H

#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tile_config;

/* Linux hands AMX's tile state to a process only when asked (ARCH_REQ_XCOMP_PERM for
 * XFEATURE_XTILEDATA; idempotent, so a race between first calls is harmless). */
static inline int amx_permitted(void) {
    static int state = -1;
    if (state < 0) state = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return state;
}

static inline void amx_configure_tiles(void) {
    amx_tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.colsb[i] = 64;
        cfg.rows[i] = 16;
    }
    _tile_loadconfig(&cfg);
}

#endif
