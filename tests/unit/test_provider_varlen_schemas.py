"""The varlen overrides against the schemas of every torch from 2.9 to 2.15, run on the installed torch.

tests/data/torch_varlen_schemas.json holds what each release registers for
``torch_attn::_varlen_attn``, ``_varlen_attn_out`` and ``_varlen_attn_backward`` (read from that
release's ``torch/nn/attention/varlen.py``, with its commit). Each release's ops are defined here
under a namespace of their own with exactly that schema, the provider's kernels built for it are
registered at the CPU key (over the CPU stand-ins of this project's ops, tests/provider_cpu.py), and
the ops are called the way that release's ``torch.nn.attention.varlen`` calls them: with every
argument by position. The dispatcher then hands the kernels their arguments as it would there,
trailing defaults left out.
"""

import importlib
import itertools
import json
import pathlib
import sys

import pytest
import torch

import cudnn_attention
from cudnn_attention import _compat, provider, sdpa_overrides
from cudnn_attention import plan as plans
from support.provider_cpu import our_ops_on_cpu, per_document_reference

RELEASES = json.loads((pathlib.Path(__file__).parents[1] / "data" / "torch_varlen_schemas.json").read_text())["releases"]
SUPPORTED = ("2.9", "2.10", "2.11", "2.12", "2.13", "2.14", "2.15")  # pyproject's torch>=2.9, through the newest release
WITH_VARLEN = [version for version in SUPPORTED if RELEASES[version]["schemas"]]
OPS = [(version, name) for version in WITH_VARLEN for name in RELEASES[version]["schemas"]]
CUDNN = int(torch.nn.attention.SDPBackend.CUDNN_ATTENTION)  # 2.15's backend argument when torch picked its cuDNN kernel

# More keys than queries per document (a KV prefix): only then does bottom-right alignment differ from top-left.
LENGTHS_Q, LENGTHS_KV, HEADS, HEAD_DIM = [3, 6, 2], [5, 9, 2], 2, 8


def _installed_release() -> str:
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def test_stored_schemas_are_the_installed_torchs():
    """The extraction behind the data (tests/data/varlen_schemas_from_wheels.py) gives what this torch registers."""
    release = RELEASES.get(_installed_release())
    if release is None:
        pytest.fail(
            f"no entry for torch {torch.__version__} in tests/data/torch_varlen_schemas.json: "
            "add it (tests/data/varlen_schemas_from_wheels.py)"
        )
    if release["schemas"]:
        importlib.import_module("torch.nn.attention.varlen")  # defines the torch_attn ops
    live = {name: str(_compat.op_schema(getattr(torch.ops.torch_attn, name))) for name in release["schemas"]}
    assert live == release["schemas"]
    assert set(provider._varlen_kernels()) == set(release["schemas"])


# ----------------------------------------------------------------------------------------------
# Binding: each argument of each release's schema lands in its own field
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("version", "name"), OPS, ids=[f"{version}-{name}" for version, name in OPS])
def test_every_argument_is_bound_by_name(version, name):
    schema = _compat.parse_schema(RELEASES[version]["schemas"][name])
    signature = sdpa_overrides.VarlenSignature(schema)
    names = [argument.name for argument in schema.arguments]
    sentinels = {argument: object() for argument in names}
    call = signature.bind(tuple(sentinels[argument] for argument in names), {})
    fields = set(sdpa_overrides.VarlenCall._fields) - {"unknown"}
    for argument in set(names) & fields:
        assert getattr(call, argument) is sentinels[argument], argument
    # Every argument is read, or only picks torch's own kernel (2.15's backend), and none is unknown.
    assert set(names) - fields <= {"backend"} and call.unknown == ()


@pytest.mark.parametrize(("version", "name"), OPS, ids=[f"{version}-{name}" for version, name in OPS])
def test_left_out_arguments_take_the_schemas_defaults(version, name):
    schema = _compat.parse_schema(RELEASES[version]["schemas"][name])
    signature = sdpa_overrides.VarlenSignature(schema)
    required = [argument.name for argument in schema.arguments if not argument.has_default_value()]
    call = signature.bind(tuple(range(len(required))), {})  # what the dispatcher passes when every default holds
    for argument in schema.arguments:
        if argument.name in sdpa_overrides.VarlenCall._fields:
            expected = argument.default_value if argument.has_default_value() else required.index(argument.name)
            assert getattr(call, argument.name) == expected, argument.name
    with pytest.raises(TypeError):  # one more than the schema has: what 2.15's backend was to a 2.13 binding by position
        signature.bind(tuple(range(len(schema.arguments) + 1)), {})


def test_an_argument_of_a_later_torch_sends_the_call_to_torch():
    # 2.15's schema plus an argument this module does not know (pytorch's main branch has tried a
    # k_cache argument on these ops): set, it could change the result, so torch serves the call.
    text = RELEASES["2.15"]["schemas"]["_varlen_attn"].replace("SymInt backend=1)", "SymInt backend=1, Tensor? k_cache=None)")
    signature = sdpa_overrides.VarlenSignature(_compat.parse_schema(text))
    args = (None,) * 7
    assert signature.bind(args, {}).unknown == ()
    assert signature.bind(args, {"k_cache": torch.zeros(1)}).unknown == ("k_cache",)
    reason = sdpa_overrides._varlen_resolve(signature.bind(args, {"k_cache": torch.zeros(1)}))[-1]
    assert reason == "arguments this version of cudnn_attention does not know: k_cache"


# ----------------------------------------------------------------------------------------------
# Through the dispatcher, as each release calls its ops
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def release_namespaces():
    """``{version: namespace}``: each release's varlen ops, defined with that release's schemas."""
    libraries, namespaces = [], {}
    for version in WITH_VARLEN:
        namespace = "cudnn_attention_torch" + version.replace(".", "_")
        library = torch.library.Library(namespace, "DEF")
        for text in RELEASES[version]["schemas"].values():
            library.define(text.split("::", 1)[1])
        libraries.append(library)
        namespaces[version] = namespace
    yield namespaces
    for library in libraries:
        _compat.destroy_library(library)


class _TorchKernels:
    """Stand-ins for torch's own op bodies: record the arguments they get, return zeros of the right shapes."""

    def __init__(self):
        self.calls = []

    def kernels(self):
        def forward(*args, **kwargs):
            self.calls.append(("_varlen_attn", args, kwargs))
            q = args[0]
            return torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0]), torch.zeros(2, dtype=torch.uint64)

        def forward_out(*args, **kwargs):
            self.calls.append(("_varlen_attn_out", args, kwargs))
            return torch.zeros(args[1].shape[1], args[1].shape[0])

        def backward(*args, **kwargs):
            self.calls.append(("_varlen_attn_backward", args, kwargs))
            return tuple(torch.zeros_like(t) for t in args[1:4])

        return {"_varlen_attn": forward, "_varlen_attn_out": forward_out, "_varlen_attn_backward": backward}


@pytest.fixture
def release_kernels(release_namespaces, monkeypatch):
    """``register(version) -> (ops, torch kernels)``: the provider's kernels, built from each op's schema, at the CPU key."""
    libraries = []

    def register(version):
        namespace = release_namespaces[version]
        ops = getattr(torch.ops, namespace)
        names = list(RELEASES[version]["schemas"])
        torch_kernels = _TorchKernels()
        kernels = sdpa_overrides.varlen_kernels(
            schemas={name: _compat.op_schema(getattr(ops, name)) for name in names},
            torch_kernels={name: kernel for name, kernel in torch_kernels.kernels().items() if name in names},
        )
        library = torch.library.Library(namespace, "IMPL")
        for name, kernel in kernels.items():
            library.impl(name, kernel, "CPU")
        libraries.append(library)
        return ops, torch_kernels

    with our_ops_on_cpu(monkeypatch):
        yield register
    for library in libraries:
        _compat.destroy_library(library)


def _packed(seed):
    generator = torch.Generator().manual_seed(seed)
    cu_q, cu_kv = (torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32) for lengths in (LENGTHS_Q, LENGTHS_KV))
    q = torch.randn(sum(LENGTHS_Q), HEADS, HEAD_DIM, generator=generator)
    k, v = (torch.randn(sum(LENGTHS_KV), HEADS, HEAD_DIM, generator=generator) for _ in range(2))
    return q, k, v, cu_q, cu_kv


def _arguments(schema, values: dict) -> list:
    """Every argument by position, as each release's varlen_attn and autograd formula pass them."""
    return [values[argument.name] for argument in schema.arguments]


def _call_values(version, seed=0):
    """A sliding window of 3 keys back where the release has window_size (2.11+), else plain causal (2.10)."""
    q, k, v, cu_q, cu_kv = _packed(seed)
    windowed = "window_size=" in RELEASES[version]["schemas"]["_varlen_attn"]
    values = {
        "query": q,
        "key": k,
        "value": v,
        "cu_seq_q": cu_q,
        "cu_seq_k": cu_kv,
        "max_q": max(LENGTHS_Q),
        "max_k": max(LENGTHS_KV),
        "is_causal": not windowed,
        "scale": None,
        "window_size": [3, 0],
        "enable_gqa": False,
        "seqused_k": None,
        "block_table": None,
        "num_splits": None,
        "backend": CUDNN,
    }
    return values, (3 if windowed else None)


@pytest.mark.parametrize("version", WITH_VARLEN)
def test_each_release_is_served_forward_and_backward(release_kernels, version):
    ops, torch_kernels = release_kernels(version)
    values, left = _call_values(version)
    out, lse, _rng = ops._varlen_attn(*_arguments(_compat.op_schema(ops._varlen_attn), values))
    grad_out = torch.randn_like(out)
    expected_out, expected_grads = per_document_reference(
        *(values[name] for name in ("query", "key", "value", "cu_seq_q", "cu_seq_k")), grad_out, left=left
    )
    torch.testing.assert_close(out, expected_out)
    assert lse.shape == (HEADS, sum(LENGTHS_Q)) and lse.is_contiguous()
    values.update(grad_out=grad_out, out=out, lse=lse, rng_state=torch.zeros(2, dtype=torch.uint64))
    grads = ops._varlen_attn_backward(*_arguments(_compat.op_schema(ops._varlen_attn_backward), values))
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want)
    assert torch_kernels.calls == []
    provider_stats = cudnn_attention.stats()["provider"]
    assert provider_stats["varlen_forward"] == 1 and provider_stats["varlen_backward"] == 1, provider_stats


@pytest.mark.parametrize("version", WITH_VARLEN)
def test_loose_maxima_are_served_as_torch_serves_them(release_kernels, version):
    # torch's varlen ops take any upper bound on the documents' lengths; the core refuses one past the token count
    # (it cannot bound a real document), so the provider clamps it to the count instead of failing a torch program.
    ops, torch_kernels = release_kernels(version)
    values, left = _call_values(version)
    values.update(max_q=2**40, max_k=sum(LENGTHS_KV) + 1)
    out, _lse, _rng = ops._varlen_attn(*_arguments(_compat.op_schema(ops._varlen_attn), values))
    expected_out, _ = per_document_reference(*(values[name] for name in ("query", "key", "value", "cu_seq_q", "cu_seq_k")), left=left)
    torch.testing.assert_close(out, expected_out)
    assert torch_kernels.calls == [] and cudnn_attention.stats()["provider"]["varlen_forward"] == 1


@pytest.mark.parametrize("version", [version for version in WITH_VARLEN if "_varlen_attn_out" in RELEASES[version]["schemas"]])
def test_each_release_out_variant_writes_out(release_kernels, version):
    ops, torch_kernels = release_kernels(version)
    values, left = _call_values(version, seed=1)
    values["out"] = out = torch.full_like(values["query"], float("nan"))
    lse = ops._varlen_attn_out(*_arguments(_compat.op_schema(ops._varlen_attn_out), values))
    expected_out, _ = per_document_reference(*(values[name] for name in ("query", "key", "value", "cu_seq_q", "cu_seq_k")), left=left)
    torch.testing.assert_close(out, expected_out)
    assert lse.shape == (HEADS, sum(LENGTHS_Q)) and torch_kernels.calls == []


@pytest.mark.parametrize("version", WITH_VARLEN)
def test_each_release_hands_torch_the_arguments_it_was_given(release_kernels, version, monkeypatch):
    # cuDNN declines: torch's own body must get exactly what the dispatcher passed (2.15: backend too).
    monkeypatch.setattr(plans, "resolve", lambda *args, **kwargs: (None, "declined in this test"))
    ops, torch_kernels = release_kernels(version)
    values, _ = _call_values(version)
    forward_args = _arguments(_compat.op_schema(ops._varlen_attn), values)
    ops._varlen_attn(*forward_args)
    values.update(
        grad_out=torch.ones_like(values["query"]),
        out=torch.zeros_like(values["query"]),
        lse=torch.zeros(HEADS, sum(LENGTHS_Q)),
        rng_state=torch.zeros(2, dtype=torch.uint64),
    )
    backward_args = _arguments(_compat.op_schema(ops._varlen_attn_backward), values)
    ops._varlen_attn_backward(*backward_args)
    (forward_name, got_forward, forward_kwargs), (backward_name, got_backward, backward_kwargs) = torch_kernels.calls
    assert (forward_name, backward_name, forward_kwargs, backward_kwargs) == ("_varlen_attn", "_varlen_attn_backward", {}, {})
    # Trailing arguments equal to their defaults are left out by the dispatcher; everything else arrives as given.
    for got, given in ((got_forward, forward_args), (got_backward, backward_args)):
        assert len(got) <= len(given) and all(a is b or a == b for a, b in zip(got, given)), (got, given)
    if version == "2.15":
        assert got_forward[-1] == CUDNN and got_backward[-1] == CUDNN
    provider_stats = cudnn_attention.stats()["provider"]
    assert provider_stats["torch_forward"] == provider_stats["torch_backward"] == {"declined in this test": 1}, provider_stats


def test_a_torch_without_varlen_gets_only_the_dense_overrides(monkeypatch):
    assert RELEASES["2.9"]["schemas"] == {}  # torch 2.9 has no torch.nn.attention.varlen
    monkeypatch.delattr(torch.nn.attention, "varlen", raising=False)
    monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", None)  # the import now fails, as on 2.9
    handle = cudnn_attention.install()
    try:
        assert handle.overridden_ops == sorted(f"aten::{name}" for name in provider._DENSE_KERNELS)
    finally:
        handle.remove()
