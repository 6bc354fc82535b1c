"""``benchmarks/errata_sweep.py`` on CPUs (its ``--device cpu`` runs the exact path): the adversarial cases are finite in
exact arithmetic (so a non-finite gradient on the GPU is the kernel's), a planted NaN is reported by name, and a kind
still broken as served makes the sweep fail."""

from support.benchmark_scripts import check_in_script


def test_the_sweep_reports_what_is_not_finite_and_fails_on_a_kind_broken_as_served():
    code = """
        import torch
        import cudnn_attention

        cases = [case for case in errata_sweep.cases(quick=True) if case[4] == 4 and case[7] == 576][:6]
        assert {case[0] for case in cases} == {"dense"} and len(cases) == 6, cases
        assert all(errata_sweep.non_finite(*case, reroute=True, device="cpu") == ("-", False) for case in cases)
        kinds = {case[:2] for case in errata_sweep.cases(quick=True)}
        assert {layout for layout, _ in kinds} == {"dense", "padded", "packed"} and len(kinds) == 18, kinds
        # --mask: that mask's kinds of the first group only (3 layouts x sinks x D x heads x 3 key lengths)
        band = list(errata_sweep._first_group(errata_sweep.cases(True, ("band over every key",))))
        assert {case[1] for case in band} == {"band over every key"} and len(band) == 72, band

        attention = cudnn_attention.attention

        class NanGradient(torch.autograd.Function):  # dQ gets a NaN, as the 64-mod-128 bug gives it; the forward is exact
            @staticmethod
            def forward(ctx, x):
                return x.view_as(x)

            @staticmethod
            def backward(ctx, grad):
                return grad * float("nan")

        def nan_in_dq(q, k, v, **kwargs):
            return attention(NanGradient.apply(q), k, v, **kwargs)

        cudnn_attention.attention = nan_in_dq
        assert errata_sweep.non_finite(*cases[0], reroute=True, device="cpu")[0] == "dq"
        errata_sweep.cases = lambda quick: cases[:2]
        assert errata_sweep.main(["--device", "cpu"]) == 1
        cudnn_attention.attention = attention
        assert errata_sweep.main(["--device", "cpu"]) == 0

        # `timeout -s INT` cuts a device call short: the table still says how many kinds ran, and is written.
        import pathlib, tempfile
        errata_sweep.cases = lambda quick: cases[:3]
        finite, calls = errata_sweep.non_finite, []

        def interrupted_third(*case, **kwargs):
            calls.append(case)
            if len(calls) == 3:
                raise KeyboardInterrupt
            return finite(*case, **kwargs)

        errata_sweep.non_finite = interrupted_third
        out = pathlib.Path(tempfile.mkdtemp())
        assert errata_sweep.main(["--device", "cpu", "--out", str(out)]) == 0
        table = (out / "errata_sweep.md").read_text()
        assert "cut short after 2 kinds" in table and "kinds: 2," in table, table
    """
    check_in_script("errata_sweep", code)
