"""What the Mamba-2 and Gated DeltaNet tests (tests/test_mamba.py, tests/test_deltanet.py) share: the
float64 comparison, a chunked kernel run against its loop with gradients, a mixer's outputs and
gradients for a fixed upstream gradient, and the tensor- and context-parallel checks against one
process.  Each test file keeps what is its layer's own (its recurrence, its reference mixer, its
shapes and its split of the parameters)."""
import pytest
import torch


def close(got, ref, rel=1e-10):
    torch.testing.assert_close(got, ref, rtol=0.0, atol=rel * float(ref.abs().max()) + 1e-300)


def run_kernel(fn, inputs, names, with_state, seed=1):
    """``fn(*inputs[names], state or None) -> (out, final state)`` with the gradients of a fixed random
    projection of both: (out, final, {input name: gradient})."""
    leaves = {n: t.clone().requires_grad_() for n, t in inputs.items()}
    out, final = fn(*(leaves[n] for n in names), leaves["state"] if with_state else None)
    gen = torch.Generator().manual_seed(seed)
    loss = (out * torch.randn(out.shape, generator=gen, dtype=out.dtype)).sum() \
        + (final * torch.randn(final.shape, generator=gen, dtype=out.dtype)).sum()
    loss.backward()
    grads = {n: t.grad for n, t in leaves.items() if n != "state" or with_state}
    return out.detach(), final.detach(), grads


def assert_kernel_equal(got, ref):
    close(got[0], ref[0])
    close(got[1], ref[1])
    for n in ref[2]:
        close(got[2][n], ref[2][n])


def hidden_states(s, width, b=2, seed=4):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(s, b, width, generator=gen, dtype=torch.float64)


def mixer_grads(m, hidden, seq_part=None, fn=None, seed=3):
    """Output, input gradient and parameter gradients of ``fn(m, hidden)`` (default ``m(hidden)``) for
    a fixed random upstream gradient of the whole sequence (``seq_part = (rank, parts)``: this part
    of it, under sequence parallelism)."""
    hidden = hidden.clone().requires_grad_()
    out = (fn or (lambda mod, x: mod(x)))(m, hidden)
    gen = torch.Generator().manual_seed(seed)
    parts = seq_part[1] if seq_part else 1
    upstream = torch.randn(out.shape[0] * parts, *out.shape[1:], generator=gen, dtype=out.dtype)
    (out * upstream.chunk(parts, 0)[seq_part[0] if seq_part else 0]).sum().backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad(set_to_none=True)
    return out.detach(), hidden.grad, grads


def tp_grads(m, hidden, mesh, sp):
    """:func:`mixer_grads` on a TP rank: with ``sp`` the rank's part of the sequence."""
    if sp:
        hidden = hidden.chunk(2, 0)[mesh.coord("tp")]
    return mixer_grads(m, hidden, (mesh.coord("tp"), 2) if sp else None)


def assert_tp_equal(out, ref, sp, split_dim):
    """Each TP rank's outputs and input gradients (its sequence part under SP) and its slices of the
    parameter gradients (``split_dim``: parameter name -> the dimension TP splits) equal one process's."""
    for rank, (y, grad_in, grads) in enumerate(out):
        close(y, ref[0].chunk(2, 0)[rank] if sp else ref[0])
        close(grad_in, ref[1].chunk(2, 0)[rank] if sp else ref[1])
        for n, dim in split_dim.items():
            close(grads[n], ref[2][n].chunk(2, dim)[rank])


def saved_bytes(m, x):
    """Bytes of the non-parameter tensors autograd keeps for backward in one forward of ``m(x)``."""
    params, seen = {p.untyped_storage().data_ptr() for p in m.parameters()}, {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(x.requires_grad_())
    return sum(seen.values())


def cp_grads(m, hidden, mesh):
    """A CP rank's output, input gradient and parameter gradients: its two chunks of ``hidden`` and of
    the same fixed upstream gradient as :func:`mixer_grads`."""
    from megazero.context_parallel import split_for_cp
    part = split_for_cp(hidden, 0, 2, mesh.coord("cp")).requires_grad_()
    out = m(part)
    gen = torch.Generator().manual_seed(3)
    upstream = torch.randn(hidden.shape, generator=gen, dtype=torch.float64)
    (out * split_for_cp(upstream, 0, 2, mesh.coord("cp"))).sum().backward()
    return out.detach(), part.grad, {n: p.grad for n, p in m.named_parameters()}


def assert_cp_equal(out, ref, broken):
    """CP 2 against one process: outputs and input gradients at each rank's tokens, parameter gradients
    summed over the ranks; with ``broken`` set (a patched piece) the comparison must fail."""
    from megazero.context_parallel import split_for_cp
    if broken:
        with pytest.raises(AssertionError):
            close(out[1][0], split_for_cp(ref[0], 0, 2, 1))
        return
    for rank, (y, grad_in, _) in enumerate(out):
        close(y, split_for_cp(ref[0], 0, 2, rank))
        close(grad_in, split_for_cp(ref[1], 0, 2, rank))
    for n in ref[2]:
        close(out[0][2][n] + out[1][2][n], ref[2][n])
