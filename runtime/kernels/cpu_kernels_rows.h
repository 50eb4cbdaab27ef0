/* The decode path's two loops over a chunk's K or V rows, for one element type of the rows: included twice
 * by cpu_kernels_impl.h (per code path), with
 *
 *   ROW_T        float (float32 pools, a chunk's dequantized scratch) or int8_t (int8 pools' codes, read in
 *                place: the caller multiplies the scores by the head's key scale and the weights by its value
 *                scale, so the codes are only widened to float in registers)
 *   ROW_LOAD(p)  VL elements at p as a vector of floats
 *   SCORES, UPDATE_ROWS  the two functions' names
 */

/* The VL dot products q . krow[jj] (jj < VL) as one vector, lane jj = key jj: VL per-key accumulators over
 * whole vectors of the head dimension, then a transposing reduction tree (log2(VL) levels of shuffle + add;
 * the accumulators are filled in bit-reversed order, which the tree's own lane order undoes), then the
 * dimensions past the last whole vector. */
static inline vf SCORES(const float *q, const ROW_T *const *krow, int64_t D) {
    static const int bitrev[VL] = {BITREV};
    vf a[VL];
    for (int64_t i = 0; i < VL; i++) a[i] = (vf){0};
    const int64_t DV = D / VL * VL;
    for (int64_t d = 0; d < DV; d += VL) {
        const vf qv = vload(q + d);
        for (int64_t jj = 0; jj < VL; jj++) a[bitrev[jj]] += qv * ROW_LOAD(krow[jj] + d);
    }
    TREE(a);
    vf out = a[0];
    if (DV < D) {
        float tail[VL];
        for (int64_t jj = 0; jj < VL; jj++) {
            float t = 0.0f;
            for (int64_t d = DV; d < D; d++) t += q[d] * (float)krow[jj][d];
            tail[jj] = t;
        }
        out += vload(tail);
    }
    return out;
}

/* Rows r0..r0+n (n <= 4) of acc: acc = acc * alpha[k] + sum_jj p[k][jj] * vrow[jj] for jj < nk, one
 * d-block at a time so the accumulators stay in registers across the chunk's keys. */
static inline void UPDATE_ROWS(float *acc, int64_t Dp, int64_t D, int64_t n, const float *alpha, const vf *p,
                               const ROW_T *const *vrow, int64_t nk) {
    int64_t d = 0;
    for (; d + UR_BLOCKS * VL <= D; d += UR_BLOCKS * VL) {
        vf a[4][UR_BLOCKS];
        for (int64_t k = 0; k < n; k++)
            for (int64_t b = 0; b < UR_BLOCKS; b++) a[k][b] = vload(acc + k * Dp + d + b * VL) * alpha[k];
        for (int64_t jj = 0; jj < nk; jj++) {
            vf v[UR_BLOCKS];
            for (int64_t b = 0; b < UR_BLOCKS; b++) v[b] = ROW_LOAD(vrow[jj] + d + b * VL);
            for (int64_t k = 0; k < n; k++) {
                const float pk = p[k][jj];
                for (int64_t b = 0; b < UR_BLOCKS; b++) a[k][b] += pk * v[b];
            }
        }
        for (int64_t k = 0; k < n; k++)
            for (int64_t b = 0; b < UR_BLOCKS; b++) vstore(acc + k * Dp + d + b * VL, a[k][b]);
    }
    for (; d + VL <= D; d += VL) {
        vf a[4];
        for (int64_t k = 0; k < n; k++) a[k] = vload(acc + k * Dp + d) * alpha[k];
        for (int64_t jj = 0; jj < nk; jj++) {
            const vf v = ROW_LOAD(vrow[jj] + d);
            for (int64_t k = 0; k < n; k++) a[k] += p[k][jj] * v;
        }
        for (int64_t k = 0; k < n; k++) vstore(acc + k * Dp + d, a[k]);
    }
    for (; d < D; d++) {
        for (int64_t k = 0; k < n; k++) {
            float t = acc[k * Dp + d] * alpha[k];
            for (int64_t jj = 0; jj < nk; jj++) t += p[k][jj] * (float)vrow[jj][d];
            acc[k * Dp + d] = t;
        }
    }
}
