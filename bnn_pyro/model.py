"""``BNN``: any ``torch.nn.Module`` turned into a Pyro model ``model(x, y=None)``.

The conversion is Pyro's own: a copy of the net becomes a ``PyroModule`` (``to_pyro_module_``) and
each selected parameter becomes a ``PyroSample`` attribute whose prior comes from ``prior``. Sites
are named after module paths (``"0.weight"``, ``"2.bias"``); hyper sites of hierarchical priors
sit beside their parameter (``"0.weight_scale"``); the likelihood adds its noise sites, the
deterministic network output ``"f"`` and the observation ``"obs"`` inside ``pyro.plate("data")``.

The network itself is evaluated functionally (``torch.func.functional_call`` on a stateless
template of the net), so one code path serves a single weight draw, vectorized ELBO particles and
thousands of posterior draws at once (:meth:`BNN.forward_draws`).

Parameters the prior leaves out (``None``, no matching pattern of a dict prior, or not selected by
``bayesian=``) stay ordinary parameters: SVI point-estimates them (type-II maximum likelihood),
MCMC keeps them fixed at their starting values (re-drawn by ``reset_parameters()`` under the fit's
seed by default; the net's own with ``init="net"``, or those of the posterior passed as ``init=``).
Parameters with ``requires_grad=False`` (a pretrained backbone frozen by ``backbone.requires_grad_(False)``)
are frozen, as laplace-torch treats them: they become buffers of the model's copy of the net, so no engine
draws, trains or re-initializes them, whatever ``init=`` says (``frozen_names`` lists them).

Example
-------
>>> net = torch.nn.Sequential(torch.nn.Linear(1, 50), torch.nn.Tanh(), torch.nn.Linear(50, 1))
>>> model = bp.BNN(net, prior=bp.priors.Normal(0., 1.), likelihood=bp.likelihoods.Gaussian(scale=0.1))
>>> trace = pyro.poutine.trace(model).get_trace(x, y)      # an ordinary Pyro model
"""

from __future__ import annotations

import copy
import math

import torch
from pyro.distributions import ImproperUniform
from pyro.nn import PyroSample
from pyro.nn.module import to_pyro_module_
from torch import nn
from torch.distributions import Distribution

from bnn_pyro import priors as priors_mod
from bnn_pyro.inputs import Inputs, check_token_ids, input_mismatch, keeps_integers, meta_only
from bnn_pyro.likelihoods import Likelihood
from bnn_pyro.priors import Hierarchical, Patterns, expand_to
from bnn_pyro.selection import Bayesian, SelectorLike, frozen_as_buffers, nothing_random, selector
from bnn_pyro.utils.checks import check_data, instance, pyro_distribution
from bnn_pyro.utils.linear_stack import linear_stack as _linear_stack
from bnn_pyro.utils.linear_stack import run_linear_stack as _run_linear_stack
from bnn_pyro.utils.linear_stack import runs_per_draw as _runs_per_draw
from bnn_pyro.utils.placement import placed_like
from bnn_pyro.utils.upstream_private import pyro_context, reparametrize_module

CPU_CHUNK_BYTES = 8 * 2**20
"""The default chunk budget of :meth:`BNN.draws_per_chunk` / :meth:`BNN.points_per_chunk` on the CPU: small chunks
stay in cache where large ones are mapped and faulted in anew."""

ACCELERATOR_CHUNK_BYTES = 128 * 2**20
"""The default chunk budget of :meth:`BNN.draws_per_chunk` / :meth:`BNN.points_per_chunk` off the CPU: the CPU's 8 MiB
keeps chunks in cache; an accelerator has no such cache to fit and pays a few kernel launches per chunk, so its
chunks are as large as this much memory (a few percent of the smallest GPU's) allows."""

__all__ = ["BNN", "Bayesian"]


class BNN(nn.Module):
    """A Bayesian neural network: a net, an explicit prior over its parameters, a likelihood.

    Parameters
    ----------
    net:
        Any ``torch.nn.Module`` mapping ``x`` of shape ``(N, ...)`` to outputs ``(N, out)``, or
        ``(N, T, out)`` for sequences (every position observed). ``x`` may be a tuple or dict of
        tensors (``net(*x)``, ``net(**x)``); integer inputs stay integer for a net with an
        ``nn.Embedding`` (:mod:`bnn_pyro.inputs`). It is copied; the user's module is never modified. Engines start from a re-draw of its
        parameters by each module's ``reset_parameters()`` under the fit's ``seed`` (``init="reset"``,
        the default), or from its current values with ``init="net"`` (a pretrained net).
    prior:
        A :mod:`bnn_pyro.priors` prior, a callable ``(name, module, param) -> Distribution | None``,
        a dict from name patterns to distributions, or one distribution for every parameter.
    likelihood:
        A :mod:`bnn_pyro.likelihoods` likelihood.
    bayesian:
        Which parameters get a prior: ``"all"`` (default), ``"weights"``, ``"no_batchnorm"``, a list
        of name patterns (``["0.*", "2.weight"]``) or a predicate ``(name, module, param) -> bool``.

    Attributes
    ----------
    sample_names:
        The random parameters (weight sites), in the net's order.
    hyper_names:
        Hyper sites of hierarchical priors (``"0.weight_scale"``, ...).
    point_names:
        The deterministic parameters: those the prior gave ``None``, that ``bayesian=`` left out, or
        that no pattern of a dict prior matched. Also shown by ``repr(model)`` as ``deterministic=``.
    frozen_names:
        The net's parameters with ``requires_grad=False``: constants (buffers of the copy) at the net's
        values for every engine; neither ``prior`` nor ``bayesian=`` applies to them.

    Notes
    -----
    At least one parameter must get a distribution (else the net is not Bayesian: an error says
    so). A ``torch.distributions`` prior is converted to the ``pyro.distributions`` one of the same
    name; a dict pattern that matches no parameter is an error that lists the parameter names.

    A ``BNN`` is the model, not a fit: ``predict``, ``summary`` and the other methods of
    :class:`~bnn_pyro.Posterior` belong to the object ``bp.fit(model, x, y, method=...)`` returns.
    """

    def __init__(self, net: nn.Module, *, prior, likelihood: Likelihood, bayesian: SelectorLike = "all"):
        super().__init__()
        instance("net", net, "torch.nn.Linear(1, 1)")
        instance("likelihood", likelihood, "bp.likelihoods.Gaussian(scale=0.1)")
        if not isinstance(net, nn.Module):
            raise TypeError(
                f"net: expected a torch.nn.Module, got {type(net).__name__}; pass a module, e.g. "
                "torch.nn.Sequential(torch.nn.Linear(1, 50), torch.nn.Tanh(), torch.nn.Linear(50, 1))."
            )
        if not isinstance(likelihood, Likelihood):
            raise TypeError(
                f"likelihood: expected a bnn_pyro.likelihoods.Likelihood, got {type(likelihood).__name__}. "
                "Try likelihood=bp.likelihoods.Gaussian(scale=0.1)."
            )
        every = dict(net.named_parameters())
        named = {name: p for name, p in every.items() if p.requires_grad}
        self.frozen_names = [name for name in every if name not in named]
        if not named:
            what = "parameters" if not every else f"trainable parameters (all {len(every)} have requires_grad=False)"
            raise ValueError(
                f"net has no {what} ({type(net).__name__}), so there is nothing to be Bayesian about; "
                "give a net with at least one layer with weights, e.g. torch.nn.Linear, or unfreeze the "
                "layers to make Bayesian (.requires_grad_(True))."
            )
        self.prior = priors_mod.as_prior(prior)
        if isinstance(self.prior, Patterns):
            self.prior.check_names(list(every))
        self.likelihood = likelihood
        select = selector(bayesian, list(named), self.frozen_names)
        self.net = frozen_as_buffers(copy.deepcopy(net), self.frozen_names)
        template = copy.deepcopy(self.net).to("meta")
        to_pyro_module_(self.net)
        object.__setattr__(self, "_template", template)  # unregistered: stateless, holds no data
        self.param_shapes = {name: p.shape for name, p in named.items()}
        self.init_values = {name: p.detach().clone() for name, p in named.items()}
        self.sample_names, self.hyper_names, self.point_names = [], [], []
        selected = []
        for name, param in named.items():
            owner_path, _, attr = name.rpartition(".")
            owner = net.get_submodule(owner_path)
            spec = None
            if select(name, owner, param):
                selected.append(name)
                spec = self.prior(name, owner, param)
            if spec is None:
                self.point_names.append(name)
                continue
            target = self.net.get_submodule(owner_path)
            if isinstance(spec, Hierarchical):
                self._add_hierarchical(name, target, attr, param, spec)
            elif isinstance(spec, Distribution):
                spec = pyro_distribution(f"prior for {name!r}", spec)
                _check_proper(name, spec)
                self._set_prior(target, attr, placed_like(_to_param_shape(name, spec, param.shape), param))
            else:
                raise TypeError(
                    f"prior for {name!r} returned {type(spec).__name__}; expected a "
                    "pyro.distributions.Distribution, a bnn_pyro.priors.Hierarchical or None; return e.g. "
                    "dist.Normal(0., 1.) (expanded to the parameter's shape for you)."
                )
            self.sample_names.append(name)
        if not self.sample_names:
            raise ValueError(nothing_random(list(named), selected))

    def _add_hierarchical(self, name, module, attr, param, spec: Hierarchical):
        shape = param.shape
        hypers = {
            k: placed_like(pyro_distribution(f"prior for {name!r} (hyper {k!r})", d), param)
            for k, d in spec.hyper.items()
        }
        for suffix, hyper in hypers.items():
            self._set_prior(module, f"{attr}_{suffix}", hyper)
            self.hyper_names.append(f"{name}_{suffix}")
        argname = f"prior for {name!r} (conditional)"
        values = {k: d.sample() for k, d in hypers.items()}
        _to_param_shape(name, pyro_distribution(argname, spec.conditional(values)), shape, exact=True)  # fail early

        def conditional(m, attr=attr, keys=tuple(hypers), make=spec.conditional):
            values = {k: getattr(m, f"{attr}_{k}") for k in keys}  # drawn on the model's device and dtype
            return placed_like(pyro_distribution(argname, make(values)), values[keys[0]])

        setattr(module, attr, PyroSample(conditional))

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)  # nn.Module's: submodules, parameters, buffers
        except AttributeError:
            if name not in _FIT_ATTRIBUTES:
                raise
        call = {"predict": "post.predict(x)", "summary": "post.summary()"}.get(name, f"post.{name}")
        raise AttributeError(
            f"model.{name}: this BNN is not fitted; {name} belongs to the Posterior that bp.fit returns. Fit it "
            f'first, then use the posterior: post = bp.fit(model, x, y, method="svi") (or "nuts", ...), then {call}.'
        ) from None

    # ---------------------------------------------------------------- the Pyro model
    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None, *, dataset_size: int | None = None):
        """The Pyro model: sample the weights, evaluate the net, observe ``y``."""
        params = self._sites()
        f, lead = self._evaluate(params, x, with_lead=True)
        if lead:  # weights carried plate dims (vectorized particles); the last one is "data"
            if f.shape[lead - 1] != 1:
                raise RuntimeError("weight samples must not be batched along the data plate.")
            f, lead = f.squeeze(lead - 1), lead - 1
        # outputs (N, T, ..., C): the dims between the row and the last belong to each row's observation
        return self.likelihood(f, y, dataset_size=dataset_size, inner_dims=f.dim() - lead - 2)

    def _sites(self) -> dict[str, torch.Tensor]:
        """Every parameter's value in the current Pyro context: samples for Bayesian ones,
        ``pyro.param`` values for deterministic ones."""
        values = {}
        with pyro_context(self.net):
            for name in self.param_shapes:
                owner_path, _, attr = name.rpartition(".")
                owner = self.net
                for part in filter(None, owner_path.split(".")):
                    owner = getattr(owner, part)
                values[name] = getattr(owner, attr)
        return values

    # ---------------------------------------------------------------- the functional path
    def forward_draws(self, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """Network outputs ``(S, N, out)`` (or ``(S, N, T, out)``) for weights batched over draws ``(S, *shape)``;
        a net :attr:`vmappable` says vmap cannot batch is evaluated one draw at a time.

        ``params`` must hold every Bayesian parameter with a leading draw dimension; missing
        deterministic parameters are taken from the model (their fitted values). It may also hold
        buffers with a leading draw dimension (per-draw BatchNorm running statistics, see
        :meth:`batchnorm_statistics`); missing buffers are the model's own.
        """
        full = {name: p for name, p in self.point_values().items() if name not in params}
        full.update(params)
        return self._evaluate(full, x)

    def features(self, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """``net[:-1](x)``, the input of an ``nn.Sequential`` net's last module (a last layer's features), for
        unbatched weights ``params`` (missing point weights and buffers are the model's own; the last module's
        are ignored). Evaluated on the stateless template, so the model itself is untouched."""
        if not isinstance(self._template, nn.Sequential) or not len(self._template):
            raise TypeError(
                f"features: the net is a {type(self._template).__name__}; expected an nn.Sequential whose last module "
                "is the head; wrap the net as nn.Sequential(body, head) to take its last layer's features."
            )
        last = f"{len(self._template) - 1}."
        weights = {k: v for k, v in {**self.point_values(), **params}.items() if k in self.param_shapes}
        buffers = self.buffers_dict()
        body = lambda d: {k: v for k, v in d.items() if not k.startswith(last)}  # noqa: E731
        return _functional(self._template[:-1], body(weights), body(buffers), x)

    def draws_per_chunk(self, x: torch.Tensor, budget_bytes: int | None = None) -> int:
        """How many weight draws to evaluate at once on ``x``: for a stack of Linear layers and
        activations, as many as keep the chunk's widest layer output near ``budget_bytes`` (default
        :meth:`_budget`'s: 8 MiB on the CPU; at most 64, at least 1), else 64. Without autograd, where the stack runs one draw at a time
        (:func:`bnn_pyro.utils.linear_stack.runs_per_draw`), only the chunk's outputs grow with the draws (the
        layers' buffers hold one draw), so the budget is on the outputs. Small chunks stay in cache where large
        ones are mapped and faulted in anew; 64 bounds the per-draw parameters gathered at once. Off the CPU the
        default budget is :data:`ACCELERATOR_CHUNK_BYTES` (:meth:`_budget`); a given budget is used as given."""
        row, budget_bytes = self._row_bytes(x), self._budget(x, budget_bytes)
        if row is None:
            return 64
        layers = _linear_stack(self._template)
        if not torch.is_grad_enabled() and _runs_per_draw(layers, x, self._template):
            row = self._template.get_submodule(layers[max(i for i, (p, a) in enumerate(layers) if a is None)][0])
            row = row.out_features * x.element_size()
        return max(1, min(64, budget_bytes // max(x.shape[0] * row, 1)))

    def points_per_chunk(self, x: torch.Tensor, budget_bytes: int | None = None) -> int:
        """How many rows of ``x`` to evaluate at once: all of them, unless one draw's widest layer output
        over all rows exceeds ``budget_bytes`` (a stack of Linear layers, whose rows are independent;
        other nets get all rows)."""
        row, budget_bytes = self._row_bytes(x), self._budget(x, budget_bytes)
        return x.shape[0] if row is None else max(1, min(x.shape[0], budget_bytes // max(row, 1)))

    @staticmethod
    def _budget(x: torch.Tensor, budget_bytes: int | None) -> int:
        """The chunk budget: ``budget_bytes`` where given, else by ``x``'s device: :data:`CPU_CHUNK_BYTES` on the
        CPU (a cache rule), :data:`ACCELERATOR_CHUNK_BYTES` elsewhere (there the budget bounds memory only, and every
        chunk costs a fixed number of kernel launches, so fewer, larger chunks are faster)."""
        if budget_bytes is not None:
            return budget_bytes
        return CPU_CHUNK_BYTES if x.device.type == "cpu" else ACCELERATOR_CHUNK_BYTES

    def _row_bytes(self, x: torch.Tensor) -> int | None:
        """Bytes of the widest layer output for one row of ``x`` and one draw (a Linear stack), or None."""
        layers = _linear_stack(self._template) if isinstance(x, torch.Tensor) and x.dim() == 2 else None
        if layers is None:
            return None
        widths = [x.shape[1]] + [self._template.get_submodule(path).out_features for path, act in layers if act is None]
        return max(widths) * x.element_size()

    def point_values(self) -> dict[str, torch.Tensor]:
        """Current values of the deterministic (non-Bayesian) parameters."""
        return {name: p.detach() for name, p in self.net.named_parameters() if name in self.point_names}

    def prior_distributions(self, *, seed: int = 0) -> dict[str, Distribution]:
        """Each random site's prior distribution, by site name (weights and hyper sites), as the model draws them:
        a hierarchical prior's conditional at hyper values drawn under ``seed`` (the caller's generators and Pyro
        parameter store are kept). What identifies the prior of a saved posterior or a checkpoint (:mod:`bnn_pyro.posterior.posterior_file`)."""
        import pyro
        import pyro.poutine as poutine

        # the caller's generators and parameter store are kept (deterministic parameters are pyro.param sites)
        with torch.random.fork_rng(devices=[]), pyro.get_param_store().scope(), torch.no_grad():
            torch.manual_seed(seed)
            trace = poutine.trace(self._sites).get_trace()
        return {name: site["fn"] for name, site in trace.nodes.items() if site["type"] == "sample"}

    def buffers_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.net.named_buffers())

    @torch.no_grad()
    def batchnorm_statistics(self, params: dict[str, torch.Tensor], batches) -> dict[str, torch.Tensor]:
        """BatchNorm running statistics recomputed for one weight draw.

        The running means and variances of every BatchNorm layer (that tracks them) are reset and
        re-estimated by a forward pass in training mode over ``batches`` (an iterable of inputs
        ``x``) with cumulative averaging (``momentum=None``: every batch weighs the same), as SWA
        and SWAG do for each set of weights (Izmailov et al. 2018, ``torch.optim.swa_utils.update_bn``).
        ``params`` holds one value (no draw dimension) per Bayesian parameter; deterministic ones
        come from the model. Returns ``{buffer name: statistic}`` (empty without BatchNorm); the
        model's own buffers are left untouched.
        """
        norms = {
            name: m
            for name, m in self._template.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
        }
        if not norms:
            return {}
        buffers = {n: b.clone() for n, b in self.buffers_dict().items()}
        for name in norms:
            prefix = f"{name}." if name else ""
            buffers[prefix + "running_mean"].zero_()
            buffers[prefix + "running_var"].fill_(1.0)
            buffers[prefix + "num_batches_tracked"].zero_()
        full = {**self.point_values(), **params}
        saved = {name: (m.momentum, m.training) for name, m in norms.items()}
        try:
            for m in norms.values():
                m.momentum = None
                m.train(True)
            for x in batches:
                torch.func.functional_call(self._template, (full, buffers), (x,))
        finally:
            for name, m in norms.items():
                m.momentum, m.training = saved[name]
        stats = [f"{name}.{k}" if name else k for name in norms for k in ("running_mean", "running_var")]
        return {n: buffers[n] for n in stats}

    def _evaluate(self, params: dict[str, torch.Tensor], x, *, with_lead: bool = False):
        """The net at ``x`` for parameters batched over leading dims: outputs ``(*lead, N, *out)``
        (with ``with_lead``, also the number of leading dims)."""
        own = self.buffers_dict()
        per_draw = {n: b for n, b in params.items() if n in own}  # e.g. BatchNorm statistics of each draw
        params = {n: p for n, p in params.items() if n not in own}
        batch_shapes = [p.shape[: p.dim() - len(self.param_shapes[n])] for n, p in params.items()]
        batch_shapes += [b.shape[: b.dim() - own[n].dim()] for n, b in per_draw.items()]
        batch = torch.broadcast_shapes(*batch_shapes)
        out = self._evaluate_batched(params, own, per_draw, batch, x)
        return (out, len(batch)) if with_lead else out

    def _evaluate_batched(self, params, own, per_draw, batch, x) -> torch.Tensor:
        buffers = {**own, **per_draw}
        if not batch:
            if torch.jit.is_tracing():
                # functional_call refuses to run under torch.jit.trace (MCMC's jit=True); the context
                # manager it wraps does the same work and traces. Deterministic parameters are
                # constants there (MCMC keeps them fixed).
                fixed = {n: p.detach() if n in self.point_names else p for n, p in params.items()}
                with reparametrize_module(self._template, {**fixed, **buffers}):
                    return _call(self._template, x)
            return _functional(self._template, params, buffers, x)
        flat = {
            n: p.expand(batch + self.param_shapes[n]).reshape((-1,) + self.param_shapes[n]) for n, p in params.items()
        }
        layers = (
            _linear_stack(self._template) if not per_draw and isinstance(x, torch.Tensor) and x.dim() == 2 else None
        )
        if layers is not None:  # batched matrix products: faster than vmap over functional_call (docstring_figures)
            frozen = {n: own[n].expand((math.prod(batch),) + own[n].shape) for n in self.frozen_names}
            out = _run_linear_stack(layers, {**frozen, **flat}, x, self._template)
            return out.reshape(batch + out.shape[1:])
        shared = {n: b for n, b in own.items() if n not in per_draw}
        flat_buffers = {n: b.expand(batch + own[n].shape).reshape((-1,) + own[n].shape) for n, b in per_draw.items()}

        def one(p, b):
            return _functional(self._template, p, {**shared, **b}, x)

        vmap_failed = False
        if self.vmappable:
            try:
                out = torch.func.vmap(one, randomness="different")(flat, flat_buffers)
                return out.reshape(batch + out.shape[1:])
            except RuntimeError:  # an op vmap cannot batch: the loop below gives the answer (or the net's own error)
                vmap_failed = True
        # a loop over draws, one at a time: the caller's chunk of draws (Posterior.predict) bounds the memory
        out = torch.stack(
            [
                one({n: p[i] for n, p in flat.items()}, {n: b[i] for n, b in flat_buffers.items()})
                for i in range(math.prod(batch))
            ]
        )
        if vmap_failed:
            object.__setattr__(self, "_loop_draws", True)  # remembered: the next call loops at once
        return out.reshape(batch + out.shape[1:])

    @property
    def vmappable(self) -> bool:
        """Whether ``torch.func.vmap`` can batch the net over weight draws. Recurrent layers (``nn.RNN``,
        ``nn.LSTM``, ``nn.GRU``) cannot (torch has no batching rule for their fused kernels), nor a net
        whose vmap failed so once; for those, draws are evaluated in a loop, one at a time."""
        return not self.__dict__.get("_loop_draws", False) and not any(
            isinstance(m, nn.RNNBase) for m in self._template.modules()
        )

    @property
    def reads_values(self) -> bool:
        """Whether the net's forward reads tensor values (a Python branch on a tensor, ``.item()``, a boolean-mask
        index, ``nonzero``): found by the shape check (:meth:`output_shape`), which cannot run such a forward on the
        meta device. A recorded graph or trace would freeze the branch taken when it was recorded, so MCMC runs
        such a net's eager gradient, and per-row Jacobians loop over the rows instead of ``vmap``-batching them."""
        return self.__dict__.get("_reads_values", False)

    @property
    def integer_inputs(self) -> bool:
        """Whether integer inputs stay integer (token ids): the net has an ``nn.Embedding``/``EmbeddingBag``.
        Otherwise integer inputs are features, cast to :attr:`dtype`."""
        return keeps_integers(self._template)

    def output_shape(self, x) -> torch.Size:
        """The shape of the network output for one row, ``(out,)`` or ``(T, ..., out)`` for sequence
        outputs, found without computation (on the meta device). Token ids of ``x`` are checked against
        the net's embeddings. A forward that needs values (a Python branch on a tensor, a boolean-mask index) or makes
        tensors on another device cannot run there: it is run once on two real rows of ``x`` at the net's initial
        weights instead (a ``ValueError`` chaining its error where that fails)."""
        check_token_ids(self._template, x)
        try:
            out = _call(self._template, x[:2].to("meta"))
        except (RuntimeError, TypeError) as err:
            if not meta_only(err):
                raise ValueError(input_mismatch(self._template, x)) from err
            if self._reads_values_on_meta(x[:2]):
                object.__setattr__(self, "_reads_values", True)  # remembered: see reads_values
            out = self._output_by_values(x[:2])
        if isinstance(out, torch.Tensor) and out.dim() < 2 and isinstance(x, torch.Tensor) and x.dim() == 1:
            raise ValueError(input_mismatch(self._template, x))  # 1-D x: the net took one row of it as one input
        if not isinstance(out, torch.Tensor) or out.dim() < 2:
            got = f"shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else f"a {type(out).__name__}"
            raise ValueError(
                f"net must map (N, ...) inputs to (N, out) outputs (or (N, T, out) for sequences); it returned {got} "
                f"for {len(x[:2])} input rows. Add a final Flatten or Linear layer, or return one tensor from forward."
            )
        return out.shape[1:]

    def _reads_values_on_meta(self, x) -> bool:
        """Whether the forward still fails as only meta tensors do where every tensor it makes is a meta tensor too
        (``torch.device("meta")``): a value read (review 27: a tensor made without ``device=`` raises first, and a
        value read behind it must still count), not a tensor made off the input's device (that alone runs and
        compiles as any other net on real tensors of one device)."""
        try:
            with torch.device("meta"):  # on a copy: a forward that makes a module would leave it on meta
                _call(copy.deepcopy(self._template), x.to("meta"))
        except (RuntimeError, TypeError) as err:
            return meta_only(err)
        return False

    def _output_by_values(self, x) -> torch.Tensor:
        """The net's output for the rows ``x`` at its initial weights, computed in eval mode (no side effect on
        buffers or the random state): the shape check for a forward the meta device cannot run (it reads values).
        Every engine runs such a net on real tensors (where ``vmap`` cannot batch it over draws, the draws are
        evaluated one at a time), so it is checked rather than refused."""
        params = {n: v.to(self.device) for n, v in self.init_values.items()}
        modes = {m: m.training for m in self._template.modules()}
        self._template.eval()  # no BatchNorm statistics updated, no dropout draw from the global generator
        devices = [self.device] if self.device.type == "cuda" else []
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=devices):  # nor any other draw the forward makes
                return self._evaluate(params, x)
        except (RuntimeError, TypeError) as err:
            raise ValueError(
                "the net's forward reads tensor values (the shape check could not run it on the meta device), so it "
                "was run once on two rows of x at the net's initial weights, and it raised (chained below); where "
                "the error is about devices, make new tensors on the input's device (torch.zeros(..., "
                f"device=x.device)). {input_mismatch(self._template, x)}"
            ) from err
        finally:
            for m, training in modes.items():
                m.training = training

    def output_dim(self, x) -> int:
        """Number of network outputs per row (per position, for sequence outputs ``(N, T, out)``)."""
        return self.output_shape(x)[-1]

    @property
    def device(self) -> torch.device:
        """The device of the model's tensors (data must be on it)."""
        return self._first_tensor().device

    @property
    def dtype(self) -> torch.dtype:
        """The floating dtype of the model's parameters (float inputs are cast to it)."""
        return self._first_tensor().dtype

    def _first_tensor(self) -> torch.Tensor:
        for t in self.net.parameters():  # deterministic parameters follow model.to(...)
            return t
        return next(iter(self.init_values.values()))  # never empty: a net without parameters is refused

    def _set_prior(self, module, attr: str, prior: Distribution) -> None:
        """``module.attr ~ prior`` (a ``PyroSample``), remembered so that :meth:`_apply` can place it anew."""
        setattr(module, attr, PyroSample(prior))
        self.__dict__.setdefault("_priors", {})[(module, attr)] = prior

    def _apply(self, fn, recurse=True):
        """``model.to(device, dtype)``, ``.double()``, ``.cuda()`` (torch routes them all through ``_apply``: see
        bnn_pyro/utils/upstream_private.py): the parameters' initial values and the priors, which are not registered
        tensors of the module, move with the net's own tensors. Conditional (hierarchical) priors follow their
        hyper draws."""
        super()._apply(fn, recurse)
        self.init_values = {n: fn(v) for n, v in self.init_values.items()}
        like = next(iter(self.init_values.values()))
        object.__setattr__(self, "_template", self._template.to(like.dtype))  # stays on the meta device
        for (module, attr), prior in list(self.__dict__.get("_priors", {}).items()):
            self._set_prior(module, attr, placed_like(prior, like))
        return self

    def train(self, mode: bool = True):
        super().train(mode)
        self._template.train(mode)
        return self

    def extra_repr(self) -> str:
        return (
            f"prior={self.prior!r}, likelihood={self.likelihood!r}, bayesian={len(self.sample_names)} tensors "
            f"({sum(math.prod(self.param_shapes[n]) for n in self.sample_names)} weights), "
            f"deterministic={self.point_names}"
            + (f", frozen={len(self.frozen_names)} tensors" if self.frozen_names else "")
        )


def _call(module: nn.Module, x):
    """``module(x)``; several inputs as ``module(*args, **kwargs)`` (:class:`~bnn_pyro.inputs.Inputs`)."""
    return x.call(module) if isinstance(x, Inputs) else module(x)


def _functional(module: nn.Module, params, buffers, x):
    if isinstance(x, Inputs):
        return torch.func.functional_call(module, (params, buffers), x.args, x.kwargs)
    return torch.func.functional_call(module, (params, buffers), (x,))


_FIT_ATTRIBUTES: set[str] = set()  # declared by bnn_pyro.posterior through fit_attributes()


def fit_attributes(names) -> None:
    """Declare ``names`` as attributes of a fitted posterior: asked of a ``BNN``, each raises an
    ``AttributeError`` that says to fit first. :mod:`bnn_pyro.posterior` declares every public name of
    ``Posterior`` when it is defined (this module does not import it: it imports this one)."""
    _FIT_ATTRIBUTES.update(names)


def check_model_data(model, x, y=None):
    """``x`` (and ``y``) checked and converted as a fit of ``model`` converts its training data
    (:func:`~bnn_pyro.utils.checks.check_data`): for a :class:`BNN`, onto its device and float dtype, token ids
    kept integer (:mod:`bnn_pyro.inputs`), ``x`` checked against the net (:meth:`BNN.output_shape`, found without
    computation) and ``y`` against the likelihood (``check_output_target``; a float64 target stays float64, as a fit always
    kept it, so fits and checkpoint folders of float64 targets are unchanged); a Pyro function model gets
    ``check_data``'s defaults. Returns ``(x, y)``, ``y`` ``None`` when not given."""
    bnn = isinstance(model, BNN)
    x, y = check_data(
        x,
        y,
        device=model.device if bnn else None,
        float_dtype=model.dtype if bnn else None,
        keep_integer=bnn and model.integer_inputs,
    )
    if bnn:
        out_shape = model.output_shape(x)
        if y is not None:
            y = model.likelihood.check_output_target(y, out_shape)
    return x, y


def _check_proper(name: str, d: Distribution) -> None:
    while d is not None:
        if isinstance(d, ImproperUniform):
            raise ValueError(
                f"prior for {name!r} is improper ({type(d).__name__}); every engine draws from the prior (site "
                "discovery, initialization, prior predictive), so the prior must be proper. Use a proper, wide "
                "prior instead, e.g. dist.Normal(0., 100.)."
            )
        d = getattr(d, "base_dist", None)


def _to_param_shape(name: str, d: Distribution, shape: torch.Size, *, exact: bool = False) -> Distribution:
    """Give ``d`` the parameter's shape as its event shape, or explain why it cannot."""
    full = d.batch_shape + d.event_shape
    try:
        fits = torch.broadcast_shapes(full, shape) == shape and len(full) <= len(shape)
    except RuntimeError:
        fits = False
    if exact:
        fits = d.event_shape == shape and d.batch_shape == ()
    if not fits or (d.event_shape and d.event_shape != shape[len(shape) - len(d.event_shape) :]):
        raise ValueError(
            f"prior for {name!r}: the distribution has batch_shape {tuple(d.batch_shape)} and event_shape "
            f"{tuple(d.event_shape)}, which does not fit the parameter's shape {tuple(shape)}. Return a scalar "
            f"distribution (it is expanded for you) or one shaped {tuple(shape)}."
        )
    if exact:
        return d
    if not d.event_shape:
        return expand_to(d, shape)
    k = len(shape) - len(d.event_shape)
    return d.expand(shape[:k]).to_event(k)
