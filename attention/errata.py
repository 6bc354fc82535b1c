"""What is known to be wrong in cuDNN's attention, by cuDNN version, and what this package does about each.

cuDNN is a moving dependency: torch pins the library it ships with (torch 2.11: 9.19, torch 2.15: 9.26), users upgrade
it on their own, and each version fixes some bugs and brings others. Every entry of :data:`ERRATA` names the class it
affects (graph kind, shapes, data condition), the versions it was seen on and fixed in, the public report or the
project's own finding, the workaround and the test that shows it. Three kinds of workaround:

* ``reroute``: the graph is built as another one that computes the same thing and is measured clean (the dense
  graph with a padding mask and every length full, for the backward bugs of unpadded dense graphs);
* ``refuse``: the graph gets the verdict of a rejection, so its calls take the exact path (counted, warned about once,
  refused in strict mode) instead of returning wrong values or faulting;
* ``none``: this package's graphs never meet it (listed so users of the loaded cuDNN know it is there).

The decision is made once per graph, from its :class:`~cudnn_attention.graph_spec.GraphSpec` (host metadata: no
device value is read) and the version of the cuDNN library the frontend loaded (``cudnn.backend_version()``), so a
rerouted or refused call costs nothing per call beyond the graph it runs. A data condition (a row whose log-sum-exp
is below -88.7) cannot be known without reading the data, so every call of an affected graph class is rerouted.
The doctor (``cudnn-attention doctor``) lists the entries that apply to the loaded cuDNN.

cuDNN numbers its versions major * 10000 + minor * 100 + patch (9.19.0 is 91900).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

__all__ = [
    "ELEMENT_LIMIT",
    "ERRATA",
    "GRID_LIMIT",
    "REFUSE",
    "REROUTE",
    "UNMET",
    "Erratum",
    "applying",
    "element_limited",
    "grid_limited",
    "matching",
    "past_element_limit",
    "version_text",
]

REROUTE, REFUSE, UNMET = "reroute", "refuse", "none"


class Erratum(NamedTuple):
    """One known bug of cuDNN's attention.

    ``first``/``fixed`` bound the versions it applies to, ``[first, fixed)`` (None leaves a side open: ``fixed`` None
    means no fixed version is known). ``affects`` says whether a graph spec is of the affected class (None for entries
    this package's graphs never meet). ``seen_on`` and ``report`` say who saw it where; ``test`` names the test
    that shows it.
    """

    key: str
    what: str
    first: int | None
    fixed: int | None
    seen_on: str
    report: str
    action: str
    workaround: str
    test: str
    affects: Callable | None = None

    def applies_to(self, version: int | None) -> bool:
        """Whether the cuDNN ``version`` is in this entry's range (an unknown version: yes)."""
        return version is None or ((self.first is None or version >= self.first) and (self.fixed is None or version < self.fixed))

    def versions(self) -> str:
        """The range as users read it: ``"before 9.26.0"``, ``"9.20.0 and later (open)"``, ``"every version"``."""
        if self.first is None and self.fixed is None:
            return "every version (no fixed one known)"
        if self.first is None:
            return f"before {version_text(self.fixed)}"
        if self.fixed is None:
            return f"{version_text(self.first)} and later (no fix known)"
        return f"{version_text(self.first)} to before {version_text(self.fixed)}"

    def line(self) -> str:
        """One paragraph for the doctor and the README."""
        return f"{self.what} [{self.versions()}; seen on {self.seen_on}; {self.report}] Here: {self.workaround}"


def version_text(version: int | None) -> str | None:
    """``91900`` -> ``"9.19.0"``."""
    return None if version is None else f"{version // 10000}.{version % 10000 // 100}.{version % 100}"


def _key_tail_reachable(spec) -> bool:
    """Whether some query row of a dense graph may see key positions at or past ``seq_kv`` (the zero-filled tail of the
    last key tile): always without a right bound; with one, when the last row's diagonal plus it reaches ``seq_kv``.
    Causal graphs (right bound 0, ``seq_q <= seq_kv``) never do: their tiles mask the tail."""
    mask = spec.mask
    if mask.right < 0:
        return True
    last_diagonal = spec.seq_kv - 1 if mask.bottom_right else spec.seq_q - 1
    return last_diagonal + mask.right >= spec.seq_kv


def _unpadded_dense_backward(spec) -> bool:
    # Padded and packed graphs carry a padding mask, which masks the key tail; both bugs below were measured clean there.
    return spec.direction == "backward" and not spec.packed and not spec.padded


def _dq_nan_at_kv_64_mod_128(spec) -> bool:
    return _unpadded_dense_backward(spec) and spec.seq_kv % 128 == 64 and _key_tail_reachable(spec)


def _dkdv_nan_single_query(spec) -> bool:
    return _unpadded_dense_backward(spec) and spec.seq_q == 1


def _plan_segfault_single_everything(spec) -> bool:
    return spec.direction == "backward" and not spec.packed and spec.batch == 1 and spec.heads_q == 1 and spec.seq_q == 1


def _packed_d256_other_dv(spec) -> bool:
    return spec.direction == "backward" and spec.packed and spec.dim_qk > 192 and spec.dim_v != spec.dim_qk


def _packed_backward_with_sinks(spec) -> bool:
    return spec.direction == "backward" and spec.packed and spec.sinks


# The largest batch, and number of heads, cuDNN's attention kernels run (entry batch-or-heads-over-65535): 65,535 passes,
# 65,536 fails. Dense calls with a larger batch are served in chunks that fit (batch_chunks); packed graphs bucket their
# document count at this at most (layouts.packed_bounds).
GRID_LIMIT = 65535


def _batch_or_heads_past_the_grid(spec) -> bool:
    return max(spec.batch, spec.heads_q, spec.heads_kv) > GRID_LIMIT


# The most elements a backward's tensor may hold (entry backward-past-2**31-elements): cuDNN 9.19 gets dQ and dK wrong in
# every row from element 2**31 of q on. Calls past it are served in head groups that stay below (head_groups).
ELEMENT_LIMIT = 2**31


def past_element_limit(*, rows_q: int, rows_kv: int, heads_q: int, heads_kv: int, dim_qk: int, dim_v: int) -> bool:
    """Whether a backward of these sizes has a tensor of more than :data:`ELEMENT_LIMIT` elements: q, O, dO and dQ (and
    cuDNN's float32 dQ accumulator) hold ``rows_q x heads_q`` rows, K, V and their gradients ``rows_kv x heads_kv``, each
    of at most ``max(dim_qk, dim_v)`` elements. Rows: B x S of a dense call, the token bucket of a packed one
    (:func:`cudnn_attention.layouts.backward_rows`)."""
    return max(rows_q * heads_q, rows_kv * heads_kv) * max(dim_qk, dim_v) > ELEMENT_LIMIT


def _backward_past_element_limit(spec) -> bool:
    if spec.direction != "backward":
        return False
    rows_q, rows_kv = (spec.total_q, spec.total_kv) if spec.packed else (spec.batch * spec.seq_q, spec.batch * spec.seq_kv)
    return past_element_limit(
        rows_q=rows_q, rows_kv=rows_kv, heads_q=spec.heads_q, heads_kv=spec.heads_kv, dim_qk=spec.dim_qk, dim_v=spec.dim_v
    )


_PADDED_VARIANT = (
    "the backward graph is built with a padding mask and every length full (the same result; that graph was measured clean), "
    "chosen from the shapes alone, with no device read"
)

ERRATA = (
    Erratum(
        key="dq-nan-kv-64-mod-128",
        what=(
            "Hopper backward of a dense graph without a padding mask: NaN in dQ when the key length is 64 mod 128 and a query "
            "row's log-sum-exp is below about -88.7 (every score of the row very negative: a query anti-aligned with every "
            "key, the 'massive activation' heads of real models). The kernel walks 128-key tiles but masks the zero-filled "
            "tail at 64-key granularity, so exp(0 - lse) overflows there."
        ),
        first=None,
        fixed=92600,
        seen_on="9.19.0 (H200, this project: S 64, 192, 320, 448, 1088 at D 64 and 128, non-causal; the padded, causal and "
        "packed graphs clean on the same data)",
        report="https://github.com/pytorch/pytorch/issues/196678, https://github.com/NVIDIA/cudnn-frontend/pull/628",
        action=REROUTE,
        workaround=_PADDED_VARIANT + " for every unpadded dense backward whose key length is 64 mod 128 and whose mask "
        "leaves the key tail reachable (no right bound, or one reaching past the last key); causal graphs are not affected",
        test="tests/gpu/test_gpu_errata.py::test_negative_lse_rows_get_finite_gradients, "
        "tests/gpu/test_gpu_errata.py::test_the_table_matches_the_loaded_cudnn",
        affects=_dq_nan_at_kv_64_mod_128,
    ),
    Erratum(
        key="dkdv-nan-single-query",
        what=(
            "Hopper backward of a dense graph without a padding mask and a single query row: NaN in every element of dK and "
            "dV when that row's log-sum-exp is very negative (about -122)."
        ),
        first=None,
        fixed=None,
        seen_on="9.25.1 and 9.26.0 (H200, upstream: B 1, H 2, S_q 1, S_kv 128, D 64, bf16, non-causal); 9.19.0 too (H200, "
        "this project, 2026-12-05: the same shape with every score near -122 gives NaN dK/dV; near -105 it is clean); "
        "9.20-9.25.0 unchecked, treated as affected",
        report="https://github.com/NVIDIA/cudnn-frontend/issues/1072 (open)",
        action=REROUTE,
        workaround=_PADDED_VARIANT + " for every unpadded dense backward with one query row (upstream: the padding mask avoids it)",
        test="tests/gpu/test_gpu_errata.py::test_negative_lse_rows_get_finite_gradients",
        affects=_dkdv_nan_single_query,
    ),
    Erratum(
        key="bwd-plan-segfault-b1-h1-s1",
        what="Backward plan creation crashes the process (segmentation fault) when B = H_q = H_kv = S_q = 1.",
        first=92000,
        fixed=None,
        seen_on="9.26.0 (H200, upstream: S_kv 128, D 64, bf16, non-causal); 9.20-9.25 unchecked, treated as affected",
        report="https://github.com/NVIDIA/cudnn-frontend/issues/1071 (open)",
        action=REFUSE,
        workaround="such a backward graph is refused before it is built, so the call takes the exact path (counted, warned "
        "about once, refused in strict mode): a crash cannot be caught",
        test="tests/unit/test_errata.py::test_refused_graphs_are_cached_rejections_before_anything_is_built",
        affects=_plan_segfault_single_everything,
    ),
    Erratum(
        key="packed-d256-other-dv-backward",
        what="Packed (ragged) backward at D 256 with a different D_v: NaN and garbage in dQ/dK/dV.",
        first=None,
        fixed=None,
        seen_on="9.19.0 (H200, this project's GPU fuzz: 13 of 4,000 cases, D_v 80 and 128)",
        report="this project's finding (docs/decisions/0009-known-wrong-cudnn-configurations.md)",
        action=REFUSE,
        workaround="the whole D > 192, D_v != D packed backward corner is refused, so those calls take the exact path",
        test="tests/unit/test_errata.py, tests/gpu/test_gpu_fuzz.py",
        affects=_packed_d256_other_dv,
    ),
    Erratum(
        key="packed-sinks-backward-stats",
        what=("Packed (THD) backward with learnable sinks in the graph: wrong dSink, or softmax statistics read out of bounds."),
        first=None,
        fixed=92600,
        seen_on="before 9.26 (TransformerEngine, reproducer D 192, H 64/8, window (511, 0), documents [2] + [598] * 8)",
        report="https://github.com/NVIDIA/TransformerEngine/issues/3249, https://github.com/NVIDIA/TransformerEngine/pull/3470",
        action=REFUSE,
        workaround=(
            "not met by calls: a packed call's backward graph never holds the sinks (dSink comes from a closed form after "
            "it; only dense calls on 9.28.1 and newer hold them, docs/decisions/0025); a packed backward graph with them "
            "(only benchmarks/sink_backward.py builds one) is refused before it is built"
        ),
        test="tests/gpu/test_gpu_packed_sinks.py, tests/unit/test_errata.py",
        affects=_packed_backward_with_sinks,
    ),
    Erratum(
        key="batch-or-heads-over-65535",
        what=(
            "Forward and backward fail at execution (a bad status, raised as an error mid-step) when the batch or the number "
            "of heads passes 65,535: 65,535 runs, 65,536 fails (a 16-bit limit)."
        ),
        first=None,
        fixed=None,
        seen_on="9.2.0 (H100, upstream: torch's cuDNN SDPA at B 65,536); 9.19.0 (H100, this project, 2026-12-05: forward "
        "and backward fail at execution at B 65,536, 131,072 and 300,000 and at 65,536 heads, B 65,535 runs right; the "
        "forward alone at B 65,536 ran right, so the backward has the limit at least); others unchecked, treated as affected",
        report="https://github.com/pytorch/pytorch/issues/181085, https://github.com/pytorch/pytorch/pull/180718 (torch's "
        "own cuDNN path refuses a batch or head count above 65,535)",
        action=REFUSE,
        workaround=(
            "a dense call with a larger batch (a vision model's windows folded into the batch, say) runs on cuDNN as batch "
            "chunks of at most 65,535 (cudnn_attention.batch_chunks; the output is copied once more); graphs past the limit "
            "are refused before they are built, so a head count above it, or a packed batch of more documents, takes the "
            "exact path (counted, warned about once, refused in strict mode); a packed graph's document bound is capped at "
            "65,535, so packed batches of up to 65,535 documents stay on cuDNN"
        ),
        test="tests/unit/test_errata.py::test_refused_graphs_are_cached_rejections_before_anything_is_built, "
        "tests/unit/test_batch_chunks.py, tests/gpu/test_gpu_errata.py::test_batches_past_the_grid_limit_are_served_in_chunks, "
        "tests/gpu/test_gpu_errata.py::test_the_grid_limit_matches_the_loaded_cudnn",
        affects=_batch_or_heads_past_the_grid,
    ),
    Erratum(
        key="backward-past-2**31-elements",
        what=(
            "Backward whose q holds more than 2**31 elements (rows x heads x head dim; a gpt-oss-shaped packed batch, 64 "
            "heads x 64, passes it at 524,288 tokens): wrong dQ and dK in every row from element 2**31 of q on, no error "
            "raised; the rows before it, the output and dV are right."
        ),
        first=None,
        fixed=92801,
        seen_on="9.19.0 (H100, this project, 2026-12-05: packed, 516 documents of 1,024 tokens, H 64/8, D 64, sinks, causal "
        "window 128: in documents 512 and 515 dQ 139x and 64x the tests' bound, dK 80x and 100x; documents 0-511 within "
        "it; the first half of the heads, copied compact, within it everywhere); clean on 9.28.1 (the same data and "
        "machine); 9.20-9.28.0 and dense graphs unchecked, treated as affected",
        report="this project's finding (docs/decisions/0024-backward-past-2-31-elements.md)",
        action=REFUSE,
        workaround=(
            "a call whose backward would pass it runs on cuDNN as head groups that each stay below (cudnn_attention."
            "head_groups: each group of query heads with the kv heads it reads and its sinks, views of dense tensors and "
            "compact copies of packed ones; where one kv head's queries are past it, as in MQA, groups of them share that "
            "kv head and their dK and dV are added; the output is copied once more); a backward graph past it is refused "
            "before it is built, so a call no grouping brings below (one query head still past it) takes the exact path "
            "(counted, warned about once, refused in strict mode)"
        ),
        test="tests/unit/test_head_groups.py, tests/gpu/test_gpu_head_groups.py, tests/gpu/test_gpu_large_offsets.py, "
        "tests/gpu/test_gpu_provider.py::test_a_backward_past_the_element_limit_is_served_in_head_groups",
        affects=_backward_past_element_limit,
    ),
    Erratum(
        key="float32-output-forward",
        what="The sink-less forward writes wrong values when asked for a float32 output.",
        first=91900,
        fixed=None,
        seen_on="9.19.0 (H200, this project: max abs error 4e37 packed, 5.1 dense); later versions unchecked, treated as affected",
        report="this project's finding (docs/decisions/0001-sink-forward-fold-or-engine.md)",
        action=UNMET,
        workaround="not met: outputs are always in the inputs' 16-bit dtype (the sink fold rounds once more instead)",
        test="none (the graph is never built)",
    ),
)


def applying(version: int | None) -> list[Erratum]:
    """The entries whose version range holds the cuDNN ``version`` (None: unknown, every entry)."""
    return [erratum for erratum in ERRATA if erratum.applies_to(version)]


def matching(spec, version: int | None) -> Erratum | None:
    """The entry a graph of ``spec`` meets on the cuDNN ``version`` (a refusal before a reroute), or None.

    An unknown version (None) matches every range: a graph is only ever built with a known one."""
    met = [e for e in ERRATA if e.affects is not None and e.applies_to(version) and e.affects(spec)]
    refusals = [e for e in met if e.action == REFUSE]
    return (refusals or met or [None])[0]


def grid_limited(version: int | None) -> bool:
    """Whether the cuDNN ``version`` has the grid limit: entry ``batch-or-heads-over-65535`` is in the table and its range
    holds ``version`` (an unknown one: yes)."""
    return _in_effect("batch-or-heads-over-65535", version)


def element_limited(version: int | None) -> bool:
    """Whether the cuDNN ``version`` gets a backward past :data:`ELEMENT_LIMIT` elements wrong: entry
    ``backward-past-2**31-elements`` is in the table and its range holds ``version`` (an unknown one: yes)."""
    return _in_effect("backward-past-2**31-elements", version)


def _in_effect(key: str, version: int | None) -> bool:
    # Read from the table at each call, so a table without the entry (a test's, a benchmark's) has no limit.
    return any(e.key == key and e.applies_to(version) for e in ERRATA)
