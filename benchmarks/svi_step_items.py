"""What one step of SVI's flat path spent beyond a7736d0's loop, item by item: the per-step work that the gradient loop
folded into ``driver.descend`` (issue 29) did and the old loop did not, each timed alone.

- ``opt.zero_grad(set_to_none=True)`` of the fused Adam over the flat ``(loc, rho)`` (``descend`` called it every step;
  the flat step assigns ``.grad``, so it now calls it only where autograd accumulates);
- the two products by the KL weight in ``negative_elbo`` (a ``(D,)`` tensor and a 0-dim one; skipped at weight 1);
- the ``FlatMeanField.weigh`` call of the objective (now only under a KL warm-up).

``D`` is the number of weights of the 1-50-1 (151) and 8-50-50-1 (3,051) nets of ``samplers_ab.py``. Each figure is
the minimum over ``--repeats`` rounds of thread CPU time per call (``time.thread_time``), one thread; on a loaded
machine read the sizes against the A/B's per-step difference, not as exact microseconds.

Usage: ``python benchmarks/svi_step_items.py [--repeats 5] [--calls 20000] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import results_dir, write_result

from bnn_pyro.infer.kl_warmup import kl_weight


def _per_call(fn, calls: int, repeats: int) -> float:
    """Microseconds per call of ``fn``: the minimum over ``repeats`` rounds of ``calls`` calls."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.thread_time() - start) / calls * 1e6)
    return best


class _Weighed:
    """The objective's bookkeeping alone: ``weigh`` sets the KL weight, ``step`` does nothing."""

    warmup_steps, kl_weight = 0, 1.0

    def weigh(self, step: int) -> _Weighed:
        self.kl_weight = kl_weight(step, self.warmup_steps)
        return self

    def step(self, x, y) -> None:
        return None


def main(args) -> str:
    torch.set_num_threads(1)
    lines = ["| item | D | us per step |", "|---|---|---|"]
    for d in (151, 3051):
        loc, rho = torch.zeros(d, requires_grad=True), torch.zeros(d, requires_grad=True)
        opt = torch.optim.Adam([loc, rho], lr=1e-2, fused=True)
        inv_scale, minus_log_q = torch.rand(d), torch.rand(())
        items = {
            "opt.zero_grad(set_to_none=True), fused Adam": lambda opt=opt: opt.zero_grad(set_to_none=True),
            "kl_weight * (D,) tensor": lambda t=inv_scale: 1.0 * t,
            "kl_weight * 0-dim tensor": lambda t=minus_log_q: 1.0 * t,
        }
        for name, fn in items.items():
            lines.append(f"| {name} | {d} | {_per_call(fn, args.calls, args.repeats):.2f} |")
    flat, batch = _Weighed(), (None, None)
    weighed = _per_call(lambda: flat.weigh(5).step(*batch), args.calls, args.repeats)
    direct = _per_call(lambda: flat.step(*batch), args.calls, args.repeats)
    lines.append(f"| FlatMeanField.weigh + kl_weight (the call with it minus without) | any | {weighed - direct:.2f} |")
    text = (
        "# SVI flat path: per-step items beyond a7736d0's loop\n\n"
        f"- minimum of {args.repeats} rounds of {args.calls} calls, thread CPU time, 1 thread\n"
        f"- command: `python benchmarks/svi_step_items.py --repeats {args.repeats} --calls {args.calls} --out {args.out}`\n\n"
        + "\n".join(lines)
        + "\n"
    )
    print(text)
    if args.out:
        write_result(results_dir("samplers_ab", args.out) / f"{args.name}.md", text)
    return text


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--out", default=None)
    parser.add_argument("--name", default="svi_step_items")
    main(parser.parse_args())
