"""A tensor-parallel decoder MLP stack whose layers end in ipcreduce's fused all-reduce +
residual add + RMSNorm, checked layer by layer against the unfused sequence (ipcreduce
all-reduce, torch add, torch rms_norm) on the same inputs.

Each layer: a column-parallel matmul (this rank's slice of the FFN width), SiLU, a
row-parallel matmul (this rank's partial sum of the hidden state), then

    normed, residual = ipcreduce.torch.all_reduce_add_rms_norm(partial, residual, w, comm, eps)

which replaces `all_reduce(partial); residual = partial + residual; normed = rms_norm(residual)`.

Run (CPU tensors, host backend): ipcreduce launch -n 2 -- python3 tp_decoder.py
    (GPUs, cuda backend): torchrun --standalone --nproc_per_node=2 tp_decoder.py --device cuda
With --device cuda --graph the fused stack is also captured in a CUDA graph and replayed
(NaN-poisoned outputs, every replay the same bits).
"""

import argparse
import os

import torch

import ipcreduce
import ipcreduce.torch as itorch

_EPS = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


class TPDecoderMLP:
    """`layers` MLP blocks sharded over `comm`'s ranks; every rank builds the same full
    weights from one seed and keeps its shard."""

    def __init__(self, comm, device, dtype, hidden: int, ffn: int, layers: int,
                 eps: float = 1e-6, seed: int = 0):
        world, rank = comm.world_size, comm.rank
        if ffn % world:
            raise ValueError(f"ffn {ffn} is not a multiple of the world size {world}")
        self.comm, self.eps, self.hidden = comm, eps, hidden
        g = torch.Generator().manual_seed(seed)
        k = ffn // world
        self.up, self.down, self.norm = [], [], []
        for _ in range(layers):
            w1 = torch.randn(hidden, ffn, generator=g) / hidden**0.5
            w2 = torch.randn(ffn, hidden, generator=g) / ffn**0.5
            self.up.append(w1[:, rank * k:(rank + 1) * k].to(device, dtype).contiguous())
            self.down.append(w2[rank * k:(rank + 1) * k].to(device, dtype).contiguous())
            self.norm.append((1.0 + 0.1 * torch.randn(hidden, generator=g)).to(device, dtype))

    def partial(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Layer i up to its all-reduce: column-parallel, SiLU, row-parallel."""
        return torch.nn.functional.silu(x @ self.up[i]) @ self.down[i]

    def fused(self, i: int, x, residual):
        return itorch.all_reduce_add_rms_norm(self.partial(i, x), residual, self.norm[i],
                                              self.comm, self.eps)

    def unfused(self, i: int, x, residual):
        s = itorch.all_reduce(self.partial(i, x), self.comm)
        residual = s + residual
        return torch.nn.functional.rms_norm(residual, (self.hidden,), self.norm[i],
                                            self.eps), residual

    def forward(self, x, residual):
        for i in range(len(self.up)):
            x, residual = self.fused(i, x, residual)
        return x, residual


def run(comm, device, dtype, tokens: int = 8, hidden: int = 4096, ffn: int = 8192,
        layers: int = 4, graph: bool = False) -> dict:
    """Runs the stack with the fused op, comparing every layer with the unfused sequence on
    the same inputs (raises past the bound); returns a report: the largest difference as a
    fraction of the bound, whether the residuals matched bitwise. Collective: every rank
    calls it with the same arguments."""
    model = TPDecoderMLP(comm, device, dtype, hidden, ffn, layers)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, hidden, generator=g).to(device, dtype)
    residual = torch.randn(tokens, hidden, generator=g).to(device, dtype)
    x0, r0 = x.clone(), residual.clone()
    worst, bitwise = 0.0, True
    for i in range(layers):
        out_f, res_f = model.fused(i, x, residual)
        out_u, res_u = model.unfused(i, x, residual)
        # Both sum in float32 in rank order and round once, then add in float32 and round:
        # the residuals are the same bits. The norms differ in summation order and rsqrt:
        # within 2 ulp of the dtype (one rounding each, plus float32 error well below one).
        bitwise &= torch.equal(res_f, res_u)
        diff = (out_f.double() - out_u.double()).abs()
        tol = 2 * _EPS[dtype] * out_u.double().abs() + 1e-30
        worst = max(worst, float((diff / tol).max()))
        if not bool((diff <= tol).all()):
            bad = int((diff > tol).sum())
            raise AssertionError(f"rank {comm.rank}: layer {i}: {bad} elements of the fused "
                                 f"output beyond 2 ulp of the unfused one")
        x, residual = out_f, res_f
    report = {"layers": layers, "tokens": tokens, "hidden": hidden, "dtype": str(dtype),
              "max_diff_of_bound": worst, "residual_bitwise": bool(bitwise)}
    if graph:
        report["graph"] = _graph_check(model, x0, r0, x, residual)
    return report


def _graph_check(model, x0, r0, x_eager, r_eager) -> dict:
    """The fused stack captured in a CUDA graph and replayed 3 times: each replay the same bits
    as the first, and as eager where cuBLAS picks the same matmul kernels in the graph as
    eagerly (it need not: then within a few bf16 ulp of it)."""
    xs, rs = x0.clone(), r0.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        model.forward(xs, rs)  # warm-up outside the capture, as torch asks
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = model.forward(xs, rs)
    first, stable = None, True
    for _ in range(3):
        for t in out:
            t.fill_(float("nan"))  # each replay must write them again
        g.replay()
        torch.cuda.synchronize()
        now = (out[0].clone(), out[1].clone())
        if first is None:
            first = now
        stable &= torch.equal(now[0], first[0]) and torch.equal(now[1], first[1])
    scale = x_eager.double().abs().max().item() + r_eager.double().abs().max().item()
    diff = max((first[0].double() - x_eager.double()).abs().max().item(),
               (first[1].double() - r_eager.double()).abs().max().item())
    return {"replays_identical": bool(stable),
            "bitwise_as_eager": torch.equal(first[0], x_eager) and torch.equal(first[1], r_eager),
            "max_diff_vs_eager_rel": diff / scale}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["bf16", "f16", "f32"], default="bf16")
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--graph", action="store_true", help="also replay a CUDA graph (cuda)")
    a = p.parse_args()
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[a.dtype]
    if a.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK") or os.environ.get("IPCREDUCE_LOCAL_RANK") or 0)
        torch.cuda.set_device(local % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
        comm = ipcreduce.init(backend="cuda")
    else:
        device = torch.device("cpu")
        comm = ipcreduce.init(backend="host")
    with comm:
        report = run(comm, device, dtype, a.tokens, a.hidden, a.ffn, a.layers,
                     graph=a.graph and a.device == "cuda")
        if a.device == "cuda":
            torch.cuda.synchronize()
            comm.check()
        print(f"rank {comm.rank}: {report}", flush=True)
        g = report.get("graph")
        graph_ok = g is None or (g["replays_identical"] and g["max_diff_vs_eager_rel"] < 2**-5)
        if not (graph_ok and report["residual_bitwise"]):
            raise SystemExit(f"rank {comm.rank}: check failed: {report}")


if __name__ == "__main__":
    main()
