"""Tolerance rules shared by the tests (docs/testing.md has the full table).

Every numeric comparison in the suite is one of:

- bit-exact (``rtol=0, atol=0`` or ``==``): the same operations on the same data in the same order;
- float64 exact math: both sides computed in float64, so a different summation order moves a sum
  of n terms by at most ``n * U64 * sum|terms|`` and a 1e-9 tolerance still catches a 1e-6 bug;
- a scaled fp32 bound, where the code path is fp32 only: ``c * U32 * magnitude``, with ``c`` from
  the number of terms summed and the number of rounding stages in the chain (each rule says how);
- a documented bf16 / fp16 tolerance.

Rounding errors scale with the magnitude of the operands that were summed, not with each output
element: an entry near zero can be the cancellation of large terms, and on another CPU (other SIMD
width, other blocking) it moves by ``u * |operands|``, which an elementwise ``rtol`` cannot cover.
So the fp32 bounds below are absolute, scaled by the largest entry of the reference tensor.
"""
U32 = 2.0 ** -24  # fp32 unit roundoff: one rounding moves x by at most U32 * |x|
U64 = 2.0 ** -53  # float64 unit roundoff

# A forward pass through the tiny GPT models of the tests (2-4 layers, width <= 128, <= 128 tokens a
# batch) is a chain of ~16 rounding stages (matmuls, norms, softmax, cross-entropy), each a sum of
# up to K = 128 products whose rounding error grows like sqrt(K) * U32 relative to the operands:
# 16 * sqrt(128) ~ 180. Forward and backward double the chain.
C_FWD = 16 * 128 ** 0.5  # ~181 U32 ~ 1.1e-5 relative to the tensor's largest entry
C_FWD_BWD = 2 * C_FWD  # ~362 U32 ~ 2.2e-5


def fp32_bound(ref, c):
    """``assert_close`` keyword arguments for ``|got - ref| <= c * U32 * max|ref|`` everywhere."""
    return dict(rtol=0.0, atol=c * U32 * float(ref.detach().abs().max()))


# Loss and gradient norm of an fp32 training run under another parallel layout, step by step
# (SGD, <= 4 steps): each is a mean or a norm over many per-token / per-parameter values whose
# errors are those of one forward + backward (C_FWD_BWD * U32 ~ 2e-5 of the largest gradient,
# observed <= 15 U32); a few SGD steps at lr <= 0.2 barely amplify them. Relative 1e-5 (170 U32)
# covers 35x the largest error observed (grad norm, 5 U32) and fails a 1e-4 change in the gradient.
R_TRAIN = 1e-5
# The same under Adam: Adam divides each coordinate by its own RMS, so a coordinate whose gradient
# is near zero (down to eps = 1e-8) turns a tiny absolute gradient error into a visible update
# error; allow 10x the SGD bound.
R_TRAIN_ADAM = 1e-4
