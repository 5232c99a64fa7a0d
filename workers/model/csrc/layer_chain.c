/* A decode step's decoder layers in one call: the CPU forward's per-layer calls (norms, the
 * four matmuls, rotary, the KV store, attention, the activation) made from C, in the order and
 * with the arguments workers/model/forward.py gives them, so the result is the same bits as
 * the Python loop's. At batch 1 that loop cost ~300 Python-to-C crossings a step (SmolLM2),
 * 10-40 us each: a third of the step. The kernels themselves stay in their own libraries
 * (quant_matmul.c, layer_ops.c, paged_attention.c): the caller passes their addresses.
 * Compiled on first use by workers/model/cpu_kernels.py; the Python side is
 * workers/model/cpu_layer_chain.py. Owns: the sequence of calls. Does not own: any arithmetic.
 */
#include <stdint.h>
#include <string.h>

typedef int (*matmul_fn)(int type, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m,
                         float *y, int num_threads);
typedef void (*rms_norm_fn)(const float *x, int64_t ldx, const float *w, float *out, int64_t rows, int64_t n,
                            float eps, int num_threads);
typedef void (*add_rms_norm_fn)(const float *x, int64_t ldx, const float *d, int64_t ldd, const float *w,
                                float *sum, float *out, int64_t rows, int64_t n, float eps, int num_threads);
typedef void (*rotary_fn)(const float *x, int64_t ldx, const float *cos_t, const float *sin_t, float *out,
                          int64_t tokens, int64_t heads, int64_t dim, int64_t half, int num_threads);
/* kv: the pool layer, fp32 or bf16: the caller passes the store and attention of its dtype */
typedef int (*store_kv_fn)(const float *k, int64_t ldk, const float *v, int64_t ldv, const int64_t *slots,
                           int64_t rows, int64_t slot_values, int64_t num_slots, void *kv);
typedef int (*attention_fn)(const float *q, const void *kv, const int64_t *tables, const uint8_t *mask,
                            const int64_t *num_keys, const int64_t *num_rows, float *out, const int64_t *dims,
                            float scale, float softcap, int num_threads);
typedef void (*act_mul_fn)(const float *x, float *out, int64_t rows, int64_t f, int act, int num_threads);

struct Kernels {
    matmul_fn matmul[2];  /* by path: 0 int8, 1 int8_panels */
    rms_norm_fn rms_norm;
    add_rms_norm_fn add_rms_norm;
    rotary_fn rotary;
    store_kv_fn store_kv;
    attention_fn attention;
    act_mul_fn act_mul;
};

enum { QKV = 0, OUT = 1, GATE_UP = 2, DOWN = 3, MAX_PARTS = 3 };

struct Layer {  /* fixed at load, except the paths (per step: they follow the row count) */
    /* matrix j is parts[j] row blocks stacked (a Q4_K_M file's qkv: Q4_K q and k, Q6_K v), part
     * p's output columns side by side: out_features[j][p] of them, weight[j][p] of type[j][p] */
    const uint8_t *weight[4][MAX_PARTS];
    int64_t type[4][MAX_PARTS], out_features[4][MAX_PARTS], path[4][MAX_PARTS], in_features[4], parts[4];
    const float *attn_norm, *ffn_norm;
    const float *qkv_bias, *out_bias;  /* NULL: none */
    void *kv;  /* the layer's pool: [2, num_blocks, block_size, kv_heads, head_dim], fp32 or bf16 */
    int64_t rotary;  /* which of the step's cos/sin tables */
    float scale, softcap;
};

struct Step {
    int64_t rows, hidden, heads, kv_heads, head_dim, half, ffn, activation, num_threads;
    float eps;
    const float *const *cos, *const *sin;  /* per rotary table: [rows, half] */
    const int64_t *slots, *tables, *num_keys, *num_rows;  /* tables [rows, max_blocks] */
    const uint8_t *mask;  /* [num_seqs, q_max, max_blocks * block_size] */
    int64_t block_size, max_blocks, num_blocks;
    /* The attention's padded batch of num_seqs x q_max query rows: q_rows [num_seqs * q_max]
     * names the step row of each (padding repeats one); padded row valid_rows[j] is step row
     * out_rows[j], j < rows. NULL valid_rows: one row per sequence, in order (the identity). */
    int64_t num_seqs, q_max;
    const int64_t *q_rows, *valid_rows, *out_rows;
    float *x, *delta, *h, *qkv, *qk, *q, *attn, *attn_pad, *gate_up, *act;  /* scratch, sized by the caller */
    float *part;  /* [rows, widest part of a stacked matrix]; NULL where no matrix is stacked */
};

enum { CHAIN_BAD_MATMUL = -10, CHAIN_BAD_SLOT = -11, CHAIN_BAD_ROWS = -12 };  /* else the attention's */

/* The step's row maps inside the buffers they index (checked before any layer runs): each
 * padded query row names a step row, each valid padded row one of the padded batch's. */
static int rows_in_bounds(const struct Step *st) {
    const int64_t padded = st->num_seqs * st->q_max;
    if (st->rows < 0 || st->num_seqs < 0 || st->q_max < 0) return 0;
    for (int64_t i = 0; i < padded; i++)
        if (st->q_rows[i] < 0 || st->q_rows[i] >= st->rows) return 0;
    if (st->valid_rows)
        for (int64_t j = 0; j < st->rows; j++)
            if (st->valid_rows[j] < 0 || st->valid_rows[j] >= padded || st->out_rows[j] < 0 ||
                st->out_rows[j] >= st->rows)
                return 0;
    return 1;
}

/* y [rows, n] = x @ W.T (+ bias: one add per value, as torch's `y + bias`); a stacked matrix's
 * parts each into `part`, then copied to their columns (StackLinear's torch.cat). */
static int matmul(const struct Kernels *kn, const struct Layer *ly, int which, const float *x, int64_t rows,
                  float *y, const float *bias, float *part, int num_threads) {
    const int64_t parts = ly->parts[which], k = ly->in_features[which];
    if (parts < 1 || parts > MAX_PARTS || (parts > 1 && !part)) return CHAIN_BAD_MATMUL;
    int64_t n = 0;
    for (int64_t p = 0; p < parts; p++) n += ly->out_features[which][p];
    for (int64_t p = 0, col = 0; p < parts; col += ly->out_features[which][p], p++) {
        const int64_t path = ly->path[which][p], width = ly->out_features[which][p];
        if (path < 0 || path > 1) return CHAIN_BAD_MATMUL;
        if (kn->matmul[path]((int)ly->type[which][p], ly->weight[which][p], width, k, x, rows, parts > 1 ? part : y,
                             num_threads))
            return CHAIN_BAD_MATMUL;
        if (parts > 1)
            for (int64_t r = 0; r < rows; r++) memcpy(y + r * n + col, part + r * width, sizeof(float) * width);
    }
    if (bias)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t j = 0; j < n; j++) y[r * n + j] += bias[j];
    return 0;
}

/* Every layer of a step of short chunks (decode, speculative verification). x [rows,
 * hidden] holds the embedded tokens and is updated in place as the residual stream; on return
 * delta holds the last layer's FFN output, and x + delta is the forward's output (the caller
 * adds them, as the Python loop's last line does). Returns 0 or a negative status (a slot
 * outside the pool, or a row map outside its buffers, is found before anything is written). */
int layer_chain(const struct Kernels *kn, const struct Layer *layers, int64_t num_layers, const struct Step *st) {
    const int64_t rows = st->rows, hidden = st->hidden, hd = st->head_dim;
    const int64_t num_qk = st->heads + st->kv_heads, qkv_width = (num_qk + st->kv_heads) * hd;
    const int threads = (int)st->num_threads;
    const int64_t dims[8] = {st->num_seqs, st->q_max, st->heads, st->kv_heads, hd, st->block_size, st->max_blocks,
                             st->num_blocks};
    const int64_t q_size = st->heads * hd;
    if (!rows_in_bounds(st)) return CHAIN_BAD_ROWS;
    for (int64_t i = 0; i < num_layers; i++) {
        const struct Layer *ly = layers + i;
        if (i == 0)  /* no residual add before the first layer's norm */
            kn->rms_norm(st->x, hidden, ly->attn_norm, st->h, rows, hidden, st->eps, threads);
        else
            kn->add_rms_norm(st->x, hidden, st->delta, hidden, ly->attn_norm, st->x, st->h, rows, hidden, st->eps,
                             threads);
        int status = matmul(kn, ly, QKV, st->h, rows, st->qkv, ly->qkv_bias, st->part, threads);
        if (status) return status;
        kn->rotary(st->qkv, qkv_width, st->cos[ly->rotary], st->sin[ly->rotary], st->qk, rows, num_qk, hd, st->half,
                   threads);
        if (kn->store_kv(st->qk + st->heads * hd, num_qk * hd, st->qkv + num_qk * hd, qkv_width, st->slots, rows,
                         st->kv_heads * hd, st->num_blocks * st->block_size, ly->kv))
            return CHAIN_BAD_SLOT;
        for (int64_t i = 0; i < st->num_seqs * st->q_max; i++)  /* the query heads, padded batch */
            memcpy(st->q + i * q_size, st->qk + st->q_rows[i] * num_qk * hd, sizeof(float) * q_size);
        status = kn->attention(st->q, ly->kv, st->tables, st->mask, st->num_keys, st->num_rows,
                               st->valid_rows ? st->attn_pad : st->attn, dims, ly->scale, ly->softcap, threads);
        if (status) return status;
        if (st->valid_rows)
            for (int64_t j = 0; j < rows; j++)
                memcpy(st->attn + st->out_rows[j] * q_size, st->attn_pad + st->valid_rows[j] * q_size,
                       sizeof(float) * q_size);
        status = matmul(kn, ly, OUT, st->attn, rows, st->delta, ly->out_bias, st->part, threads);
        if (status) return status;
        kn->add_rms_norm(st->x, hidden, st->delta, hidden, ly->ffn_norm, st->x, st->h, rows, hidden, st->eps, threads);
        status = matmul(kn, ly, GATE_UP, st->h, rows, st->gate_up, NULL, st->part, threads);
        if (status) return status;
        kn->act_mul(st->gate_up, st->act, rows, st->ffn, (int)st->activation, threads);
        status = matmul(kn, ly, DOWN, st->act, rows, st->delta, NULL, st->part, threads);
        if (status) return status;
    }
    return 0;
}
