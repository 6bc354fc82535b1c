"""``benchmarks/torch_sdpa_cudnn.py``'s verdicts, on the CPU: the math backend stands in for torch's cuDNN one, so every
row it computes passes; a result pushed off by more than the bound, a NaN where float64 has none, and a refused kernel
must each say so."""

from __future__ import annotations

from support.benchmark_scripts import check_in_script


def test_the_check_passes_the_math_backend_and_catches_an_error_a_nan_and_a_refusal():
    out = check_in_script(
        "torch_sdpa_cudnn",
        """
        import torch
        from torch.nn.attention import SDPBackend
        import torch_sdpa_cudnn as check

        picked = [c for c in check.cases() if c[9] in ("gqa", "mask", "bshd", "adversarial")][:4] + check.cases()[:2]
        small = [(label, B, H, H_kv, min(S_q, 96), min(S_kv, 160), D, causal, dtype, extra)
                 for label, B, H, H_kv, S_q, S_kv, D, causal, dtype, extra in picked]
        for case in small:
            verdicts = check.row(case, device="cpu", served_by=SDPBackend.MATH)["verdicts"]
            assert all(ok for _, _, ok in verdicts.values()), (case, verdicts)

        real_run = check.run

        def third_call(change):  # row() runs the float64 reference, then the math backend, then the served one
            calls = []

            def run(*args, **kwargs):
                calls.append(1)
                result = real_run(*args, **kwargs)
                return change(result) if len(calls) == 3 else result

            return run

        def failing(verdicts):
            return [name for name, (_, _, ok) in verdicts.items() if not ok]

        case = small[-1]
        check.run = third_call(lambda r: {**r, "dk": r["dk"] + 0.05})
        assert failing(check.row(case, device="cpu", served_by=SDPBackend.MATH)["verdicts"]) == ["dk"]
        check.run = third_call(lambda r: {**r, "dq": r["dq"].index_fill(-1, torch.tensor([0]), float("nan"))})
        assert failing(check.row(case, device="cpu", served_by=SDPBackend.MATH)["verdicts"]) == ["dq"]

        def refuse(result):
            raise RuntimeError("No available kernel. Aborting execution.")

        check.run = third_call(refuse)
        assert check.row(case, device="cpu", served_by=SDPBackend.MATH)["refused"].startswith("No available kernel")
        print("ok")
        """,
    )
    assert out.endswith("ok")
