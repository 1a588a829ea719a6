/*
 * How an array's elements are stored: a KV cache's rows, the rows a store reads (float32 or
 * bfloat16), a step's logits (the same two).  The one definition of these codes: every C file
 * includes it, and native/ops.py's `Kind` mirrors it (tests/unit/test_native_ops.py reads this
 * header and compares).  4 was "fp8 through the table", before each fp8 format had its own kind.
 */
#ifndef KVSERVE_KINDS_H
#define KVSERVE_KINDS_H

/* KV_I4: two 4-bit codes a byte, value 2j in byte j's low nibble; a row of dim values is
 * dim / 2 bytes, its value (code - 7.5) x the row's scale (kv_quant.py). */
enum kv_kind { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2, KV_I8 = 3, KV_E4M3 = 5, KV_E5M2 = 6, KV_I4 = 7 };

#endif
