//! `y[m, n] = Σ_k x[m, k] · W[n, k]` with `W` in bfloat16 (raw `u16` bits), `x`, `y` float32.

use crate::KernelError;

/// The most activation rows one call takes; more rows are a GEMM's job.
pub const MAX_ROWS: usize = 16;

/// Rows of `W` handled together (their accumulators live in registers at once).
const NB: usize = 4;

/// Which instruction set the kernel runs with on this machine.
pub fn simd_level() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return "avx512f";
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return "avx2+fma";
        }
    }
    "portable"
}

#[inline]
fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// Computes `y = x · Wᵀ`: `x` is `[m, k]`, `w` is `[n, k]` (bfloat16 bits), `y` is `[m, n]`,
/// all row-major, `m <= MAX_ROWS`.
pub fn matmul_bf16(
    x: &[f32],
    m: usize,
    k: usize,
    w: &[u16],
    n: usize,
    y: &mut [f32],
) -> Result<(), KernelError> {
    let err = |problem: String| KernelError::Shape {
        kernel: "matmul_bf16",
        problem,
    };
    if m == 0 || m > MAX_ROWS {
        return Err(err(format!("{m} rows; 1..={MAX_ROWS} supported")));
    }
    if x.len() != m * k || w.len() != n * k || y.len() != m * n {
        return Err(err(format!(
            "x has {} values for [{m}, {k}], w {} for [{n}, {k}], y {} for [{m}, {n}]",
            x.len(),
            w.len(),
            y.len()
        )));
    }
    if n == 0 {
        return Ok(());
    }
    matmul_bf16_at(simd_level(), x, m, k, w, n, y);
    Ok(())
}

/// The body of [`matmul_bf16`] with the instruction set chosen by the caller (tests run
/// every path the machine has). Shapes are checked by the caller.
fn matmul_bf16_at(
    level: &'static str,
    x: &[f32],
    m: usize,
    k: usize,
    w: &[u16],
    n: usize,
    y: &mut [f32],
) {
    let pool = crate::pool::global();
    let workers = pool.active();
    // Rows of W per worker, in whole register blocks.
    let per = n.div_ceil(workers).div_ceil(NB) * NB;
    let out = SendPtr(y.as_mut_ptr());
    pool.run_on(workers, &|wi| {
        let j0 = (wi * per).min(n);
        let j1 = (j0 + per).min(n);
        if j0 < j1 {
            // SAFETY: worker wi writes y[mi * n + j] only for its own j in [j0, j1), so
            // writes never overlap; y outlives `run`, which waits for every worker.
            unsafe { block_rows(level, x, m, k, w, n, j0, j1, out) };
        }
    });
}

#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: used only for disjoint writes, see above.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

/// # Safety
/// `y` must point to `m * n` floats; rows `[j0, j1)` of the output are written.
#[allow(clippy::too_many_arguments)]
unsafe fn block_rows(
    level: &str,
    x: &[f32],
    m: usize,
    k: usize,
    w: &[u16],
    n: usize,
    j0: usize,
    j1: usize,
    y: SendPtr,
) {
    #[cfg(target_arch = "x86_64")]
    {
        if level == "avx512f" {
            return x86::rows_avx512(x, m, k, w, n, j0, j1, y.0);
        }
        if level == "avx2+fma" {
            return x86::rows_avx2(x, m, k, w, n, j0, j1, y.0);
        }
    }
    let _ = level;
    for j in j0..j1 {
        let wr = &w[j * k..(j + 1) * k];
        for mi in 0..m {
            let xr = &x[mi * k..(mi + 1) * k];
            let mut acc = 0f32;
            for (a, b) in xr.iter().zip(wr) {
                acc += a * bf16_to_f32(*b);
            }
            *y.0.add(mi * n + j) = acc;
        }
    }
}

#[cfg(target_arch = "x86_64")]
// Register-block loops index several arrays by the same row and column numbers; iterators
// would hide that.
#[allow(clippy::needless_range_loop)]
mod x86 {
    use super::{bf16_to_f32, NB};
    use std::arch::x86_64::*;

    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn rows_avx512(
        x: &[f32],
        m: usize,
        k: usize,
        w: &[u16],
        n: usize,
        j0: usize,
        j1: usize,
        y: *mut f32,
    ) {
        let kv = k / 16 * 16;
        let mut j = j0;
        while j < j1 {
            let nb = NB.min(j1 - j);
            // Up to 4 rows of x at a time against nb rows of W.
            let mut mi0 = 0;
            while mi0 < m {
                let mb = 4.min(m - mi0);
                let mut acc = [[_mm512_setzero_ps(); 4]; NB];
                let mut kk = 0;
                while kk < kv {
                    let mut wv = [_mm512_setzero_ps(); NB];
                    // Ask for the next block of rows while this one computes: one core
                    // alone does not keep enough loads in flight to use DRAM's bandwidth.
                    if kk % 32 == 0 && j + NB < n {
                        for r in 0..NB {
                            let next = (j + 2 * NB + r) * k + kk;
                            if next < w.len() {
                                _mm_prefetch::<_MM_HINT_T0>(w.as_ptr().add(next) as *const i8);
                            }
                        }
                    }
                    for r in 0..nb {
                        let p = w.as_ptr().add((j + r) * k + kk) as *const __m256i;
                        let raw = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p));
                        wv[r] = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(raw));
                    }
                    for c in 0..mb {
                        let xv = _mm512_loadu_ps(x.as_ptr().add((mi0 + c) * k + kk));
                        for r in 0..nb {
                            acc[r][c] = _mm512_fmadd_ps(wv[r], xv, acc[r][c]);
                        }
                    }
                    kk += 16;
                }
                for r in 0..nb {
                    for c in 0..mb {
                        let mut s = _mm512_reduce_add_ps(acc[r][c]);
                        for t in kv..k {
                            s += x[(mi0 + c) * k + t] * bf16_to_f32(w[(j + r) * k + t]);
                        }
                        *y.add((mi0 + c) * n + j + r) = s;
                    }
                }
                mi0 += mb;
            }
            j += nb;
        }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum256(v: __m256) -> f32 {
        let hi = _mm256_extractf128_ps::<1>(v);
        let lo = _mm256_castps256_ps128(v);
        let s = _mm_add_ps(hi, lo);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<0x55>(s, s));
        _mm_cvtss_f32(s)
    }

    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn rows_avx2(
        x: &[f32],
        m: usize,
        k: usize,
        w: &[u16],
        n: usize,
        j0: usize,
        j1: usize,
        y: *mut f32,
    ) {
        let kv = k / 8 * 8;
        let mut j = j0;
        while j < j1 {
            let nb = NB.min(j1 - j);
            let mut mi0 = 0;
            while mi0 < m {
                let mb = 2.min(m - mi0);
                let mut acc = [[_mm256_setzero_ps(); 2]; NB];
                let mut kk = 0;
                while kk < kv {
                    let mut wv = [_mm256_setzero_ps(); NB];
                    for r in 0..nb {
                        let p = w.as_ptr().add((j + r) * k + kk) as *const __m128i;
                        let raw = _mm256_cvtepu16_epi32(_mm_loadu_si128(p));
                        wv[r] = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(raw));
                    }
                    for c in 0..mb {
                        let xv = _mm256_loadu_ps(x.as_ptr().add((mi0 + c) * k + kk));
                        for r in 0..nb {
                            acc[r][c] = _mm256_fmadd_ps(wv[r], xv, acc[r][c]);
                        }
                    }
                    kk += 8;
                }
                for r in 0..nb {
                    for c in 0..mb {
                        let mut s = hsum256(acc[r][c]);
                        for t in kv..k {
                            s += x[(mi0 + c) * k + t] * bf16_to_f32(w[(j + r) * k + t]);
                        }
                        *y.add((mi0 + c) * n + j + r) = s;
                    }
                }
                mi0 += mb;
            }
            j += nb;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    fn reference(x: &[f32], m: usize, k: usize, w: &[u16], n: usize) -> Vec<f64> {
        let mut y = vec![0f64; m * n];
        for mi in 0..m {
            for j in 0..n {
                y[mi * n + j] = (0..k)
                    .map(|t| x[mi * k + t] as f64 * bf16_to_f32(w[j * k + t]) as f64)
                    .sum();
            }
        }
        y
    }

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    fn levels() -> Vec<&'static str> {
        let mut v = vec!["portable"];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                v.push("avx2+fma");
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                v.push("avx512f");
            }
        }
        v
    }

    #[test]
    fn matches_f64_reference_at_awkward_sizes() {
        let mut seed = 42;
        // k: below, at and above one vector, with tails; n: partial blocks; m: 1..MAX_ROWS.
        for &(m, k, n) in &[
            (1, 1, 1),
            (1, 15, 3),
            (1, 16, 4),
            (2, 17, 5),
            (3, 576, 193),
            (4, 64, 8),
            (5, 100, 37),
            (8, 576, 960),
            (16, 48, 7),
            (1, 1536, 576),
        ] {
            let x: Vec<f32> = (0..m * k).map(|_| lcg(&mut seed)).collect();
            let w: Vec<u16> = (0..n * k)
                .map(|_| bf16::from_f32(lcg(&mut seed)).to_bits())
                .collect();
            let r = reference(&x, m, k, &w, n);
            for level in levels() {
                let mut y = vec![f32::NAN; m * n];
                matmul_bf16_at(level, &x, m, k, &w, n, &mut y);
                for (i, (a, b)) in y.iter().zip(&r).enumerate() {
                    let tol = 1e-5 * (k as f64).sqrt().max(1.0);
                    assert!(
                        (*a as f64 - b).abs() <= tol,
                        "m={m} k={k} n={n} [{i}]: {a} vs {b} ({level})"
                    );
                }
            }
            let mut y = vec![f32::NAN; m * n];
            matmul_bf16(&x, m, k, &w, n, &mut y).unwrap();
            assert!(y.iter().all(|v| v.is_finite()));
        }
    }

    #[test]
    fn concurrent_callers_get_their_own_results() {
        // Several threads share the one pool; each must get exactly its own product.
        let handles: Vec<_> = (0..4)
            .map(|t| {
                std::thread::spawn(move || {
                    let (m, k, n) = (2, 96, 130);
                    let x: Vec<f32> = (0..m * k).map(|i| ((i + t) % 13) as f32 * 0.1).collect();
                    let w: Vec<u16> = (0..n * k)
                        .map(|i| bf16::from_f32(((i * 7 + t) % 11) as f32 * 0.05).to_bits())
                        .collect();
                    let r = reference(&x, m, k, &w, n);
                    for _ in 0..50 {
                        let mut y = vec![0f32; m * n];
                        matmul_bf16(&x, m, k, &w, n, &mut y).unwrap();
                        for (a, b) in y.iter().zip(&r) {
                            assert!((*a as f64 - b).abs() < 1e-3, "{a} vs {b}");
                        }
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
    }

    #[test]
    fn shape_errors_are_reported() {
        let mut y = vec![0f32; 4];
        let e = matmul_bf16(&[0.0; 3], 1, 4, &[0; 16], 4, &mut y).unwrap_err();
        assert!(e.to_string().contains("x has 3 values"), "{e}");
        let e = matmul_bf16(&[0.0; 68], 17, 4, &[0; 16], 4, &mut y).unwrap_err();
        assert!(e.to_string().contains("17 rows"), "{e}");
    }
}
