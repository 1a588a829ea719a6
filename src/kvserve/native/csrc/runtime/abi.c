/*
 * The sizes of the argument structures that native/ops.py mirrors with ctypes, so that it can
 * refuse a library whose structures differ from its own (a field added on one side only)
 * before any call reads past one.  `which` follows ops.py's STRUCT_SIZES order.
 */
#include <stdint.h>

#include "attention/attention.h"
#include "layer/layer.h"

int64_t native_struct_size(int which) {
    switch (which) {
    case 0: return (int64_t)sizeof(paged_decode_args);
    case 1: return (int64_t)sizeof(prefill_attention_args);
    case 2: return (int64_t)sizeof(decode_layer);
    case 3: return (int64_t)sizeof(decode_step_args);
    default: return -1;
    }
}
