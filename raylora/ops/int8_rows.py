"""raylora's own int8 kernels for the few rows of a decode step, on x86 CPUs with AVX2: an exact int8 x int8 -> int32
matmul, and a whole W8A8 linear of float32 rows in one call.

A decode step of a small batch multiplies 1 to 3 activation rows by every int8 weight of the model, streamed from
memory, and runs each linear's quantisation and rescale as a dozen small torch ops. On a 2-core AMD EPYC with VNNI
(``bench/int8_kernel.py``), a pass through SmolLM2's 134 MB of int8 weights at one row took 5.3 ms here against 13.5 ms
with ``torch._int_mm`` (oneDNN), and the serving engine decoded 44.5 against 34.0 tokens/s at batch 1.
``torch._weight_int8pack_mm`` took 7x ``torch._int_mm``'s time there; torch has no other exact int8 kernel for the CPU.

The kernels are C with AVX2 intrinsics (llama.cpp's Q8_0 dot product: ``|x| * (w * sign(x))`` with ``maddubs``,
whose pairs of products of values in [-127, 127] stay below 2^15, so no sum saturates), parallel over the weight's
rows with OpenMP (torch's own runtime, already loaded), each float operation rounded as torch rounds it. They are
compiled once per machine by the system's C compiler into raylora's cache at first use; without a compiler, or on
another CPU, they raise (:func:`unavailable` says why) and are no candidate. :mod:`raylora.ops.int8` times the matmul
against the others and uses both only where it is the fastest.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from raylora.paths import cache_home

SOURCE = r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

static inline int32_t hsum(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* The dot products of int8 rows q (rows x k) with every int8 row of w (n x k), each given to emit(m, j, sum); every
   value in [-127, 127]. Each weight row is read once for up to 4 rows of q. */
#define DOTS(EMIT)                                                                                                     \
    const int64_t body = k & ~(int64_t)31;                                                                             \
    const __m256i ones = _mm256_set1_epi16(1);                                                                         \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                                                  \
    for (int64_t j = 0; j < n; j++) {                                                                                  \
        const int8_t *wj = w + j * k;                                                                                  \
        for (int64_t m0 = 0; m0 < rows; m0 += 4) {                                                                     \
            const int64_t count = rows - m0 < 4 ? rows - m0 : 4;                                                       \
            __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),                  \
                              _mm256_setzero_si256()};                                                                 \
            for (int64_t i = 0; i < body; i += 32) {                                                                   \
                const __m256i y = _mm256_loadu_si256((const __m256i *)(wj + i));                                       \
                for (int64_t m = 0; m < count; m++) {                                                                  \
                    const __m256i x = _mm256_loadu_si256((const __m256i *)(q + (m0 + m) * k + i));                     \
                    const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x));            \
                    acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(p, ones));                                     \
                }                                                                                                      \
            }                                                                                                          \
            for (int64_t m = 0; m < count; m++) {                                                                      \
                const int8_t *qm = q + (m0 + m) * k;                                                                   \
                int32_t s = hsum(acc[m]);                                                                              \
                for (int64_t i = body; i < k; i++) s += (int32_t)qm[i] * (int32_t)wj[i];                               \
                EMIT(m0 + m, j, s);                                                                                    \
            }                                                                                                          \
        }                                                                                                              \
    }

#define TO_INT32(m, j, s) out[(m) * n + (j)] = (s)

/* out = q @ w.T in int32. */
void raylora_int8_rows(const int8_t *q, const int8_t *w, int32_t *out, int64_t rows, int64_t n, int64_t k,
                       int threads) {
    DOTS(TO_INT32)
}

#define RESCALED(m, j, s)                                                                                              \
    do {                                                                                                               \
        float v = ((float)(s) * scale[m]) * w_scale[j];                                                                \
        out[(m) * n + (j)] = bias ? v + bias[j] : v;                                                                   \
    } while (0)

/* The W8A8 linear of raylora.ops.int8.w8a8_linear on float32 rows x (rows x k), step by step as it computes it:
   x * smooth, one scale per row (max |x| clamped to 1e-8, over 127), the row divided by it and rounded half to even,
   the int8 dot products, then (sum * the row's scale) * w_scale[j] (+ bias[j]). smooth and bias may be NULL. */
void raylora_w8a8_rows(const float *x, const float *smooth, const int8_t *w, const float *w_scale, const float *bias,
                       float *out, int8_t *q, float *scale, int64_t rows, int64_t n, int64_t k, int threads) {
    for (int64_t m = 0; m < rows; m++) {
        const float *xm = x + m * k;
        float top = 0.0f;
        for (int64_t i = 0; i < k; i++) {
            const float a = fabsf(smooth ? xm[i] * smooth[i] : xm[i]);
            if (!(a <= top)) top = a; /* a NaN stays, as in torch's amax */
        }
        scale[m] = (top < 1e-8f ? 1e-8f : top) / 127.0f;
        for (int64_t i = 0; i < k; i++)
            q[m * k + i] = (int8_t)nearbyintf((smooth ? xm[i] * smooth[i] : xm[i]) / scale[m]);
    }
    DOTS(RESCALED)
}
"""
# No FMA contraction, no reciprocal division: each float operation rounds as torch's does.
FLAGS = ("-O3", "-mavx2", "-ffp-contract=off", "-fno-fast-math", "-fopenmp", "-shared", "-fPIC")


def int8_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch._int_mm``'s signature: ``a`` (M, K) int8 times ``b`` (K, N) int8 (a Linear's ``weight.t()``, read
    without a copy) -> (M, N) int32, on the CPU.

    Raises:
        RuntimeError: not int8 CPU tensors, or the kernel cannot run here (:func:`unavailable` says why).
    """
    library = _library()
    if isinstance(library, str) or a.device.type != "cpu" or b.device.type != "cpu":
        raise RuntimeError(f"int8 rows (AVX2): {library if isinstance(library, str) else 'CPU tensors only'}")
    if a.dtype != torch.int8 or b.dtype != torch.int8:
        raise RuntimeError("int8 rows (AVX2): int8 tensors only")
    a, w = a.contiguous(), b.t().contiguous()
    out = torch.empty(a.shape[0], w.shape[0], dtype=torch.int32)
    library.raylora_int8_rows(a.data_ptr(), w.data_ptr(), out.data_ptr(), a.shape[0], w.shape[0], a.shape[1],
                              torch.get_num_threads())  # fmt: skip
    return out


def w8a8_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    smooth: torch.Tensor | None,
) -> torch.Tensor:
    """:func:`raylora.ops.int8.w8a8_linear` of float32 rows on the CPU in one call: the smoothing, the per-row
    quantisation, the int8 products and the rescale, each rounded as torch rounds it, so bitwise the same result.
    Every tensor float32 but the int8 ``weight``; the kernels must be available (:func:`unavailable`)."""
    library = _library()
    rows, k = x.shape
    # each held in a name until the call returns: a pointer into a temporary's memory would outlive it
    x, weight, weight_scale = x.contiguous(), weight.contiguous(), weight_scale.contiguous()
    bias, smooth = (None if t is None else t.contiguous() for t in (bias, smooth))
    out = torch.empty(rows, weight.shape[0])
    work, scale = torch.empty(rows, k, dtype=torch.int8), torch.empty(rows)
    library.raylora_w8a8_rows(
        x.data_ptr(), None if smooth is None else smooth.data_ptr(), weight.data_ptr(), weight_scale.data_ptr(),
        None if bias is None else bias.data_ptr(), out.data_ptr(), work.data_ptr(), scale.data_ptr(), rows,
        weight.shape[0], k, torch.get_num_threads(),
    )  # fmt: skip
    return out


def unavailable() -> str | None:
    """Why the kernels cannot run on this machine, or None when they can."""
    library = _library()
    return library if isinstance(library, str) else None


@functools.cache
def _library() -> ctypes.CDLL | str:
    """The compiled library (ctypes releases the GIL for each call), or why there is none."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not an x86 CPU ({platform.machine()})"
    capability = torch.backends.cpu.get_cpu_capability()  # "AVX2", "AVX512", ... as torch's kernels use
    if not capability.startswith(("AVX2", "AVX512")):
        return f"the CPU has no AVX2 (torch reports {capability})"
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        return f"no C compiler ({os.environ.get('CC', 'cc')}) to build it"
    digest = hashlib.sha256(f"{SOURCE}{FLAGS}".encode()).hexdigest()[:16]
    path = cache_home() / "kernels" / f"int8_rows-{digest}.so"
    if not path.is_file():
        problem = _compile(compiler, path)
        if problem:
            return problem
    library = ctypes.CDLL(str(path))
    library.raylora_int8_rows.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    library.raylora_w8a8_rows.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    library.raylora_int8_rows.restype = library.raylora_w8a8_rows.restype = None
    return library


def _compile(compiler: str, library: Path) -> str | None:
    """Compile :data:`SOURCE` into ``library`` (written whole or not at all: processes may compile at once); None, or
    why it failed."""
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
        source, built = os.path.join(tmp, "int8_rows.c"), os.path.join(tmp, "int8_rows.so")
        with open(source, "w") as f:
            f.write(SOURCE)
        done = subprocess.run([compiler, *FLAGS, "-o", built, source, "-lm"], capture_output=True, timeout=120)
        if done.returncode != 0:
            return f"{compiler} failed: {done.stderr.decode(errors='replace').strip()[-500:]}"
        os.replace(built, library)
    return None
