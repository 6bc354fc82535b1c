"""``cudnn-attention doctor``: the report, its exit status, and the check logic run on the CPU.

On the CPU every call takes the exact path, so the self-checks measure it against itself in float64; a stand-in for
the package's call (relabelled as served by cuDNN, or corrupted) shows what passes and what fails.
"""

import json

import pytest
import torch

from cudnn_attention import doctor, environment, errata
from cudnn_attention.integrations.hf import launch
from support.fake_frontend import install_fake_frontend

# Small shapes: the real ones (D 128, 256 tokens) cost about 30 s of float64 on two CPU cores.
SMALL = {"_BATCH": 2, "_HEADS": 4, "_KV_HEADS": 2, "_SEQ": 24, "_DIM": 16, "_PADDED_LENGTHS": (24, 9), "_DOCUMENTS": (9, 1, 5, 9)}


@pytest.fixture
def small(monkeypatch):
    for name, value in SMALL.items():
        monkeypatch.setattr(doctor, name, value)


@pytest.mark.no_gpu
def test_without_a_gpu_the_report_names_the_versions_and_exits_1(capsys):
    assert launch.main(["doctor"]) == 1
    text = capsys.readouterr().out
    for line in ("torch", "cuda", "cudnn_backend", "cudnn_frontend", "transformers", "lightning", "gpu"):
        assert f"\n  {line} " in text, line
    assert torch.__version__ in text
    assert doctor.NO_GPU in text and "0 of 0 checks passed; exit status 1" in text
    if environment.versions()["cudnn_backend"] is None:  # a CPU build of torch: no cuDNN library to ask
        assert "known issues (cuDNN version unknown: all of them)" in text and "D 256" in text


@pytest.mark.no_gpu
def test_a_login_node_without_a_gpu_lists_the_loaded_cudnns_issues(capsys, monkeypatch):
    # A CUDA build of torch on a machine without a GPU: the frontend still reads its library's version (measured with
    # torch 2.15.0+cu132 over cuDNN 9.28.1.4: 92801), so the report names that version's entries, not every one.
    install_fake_frontend(monkeypatch, 92801)
    assert launch.main(["doctor"]) == 1
    text = capsys.readouterr().out
    assert "known issues of cuDNN 9.28.1:" in text and "dkdv-nan-single-query" in text, text
    assert "dq-nan-kv-64-mod-128" not in text and doctor.NO_GPU in text


@pytest.mark.no_gpu
def test_json_report_parses(capsys, tmp_path):
    assert launch.main(["doctor", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["exit_status"] == 1 and report["checks"] == [] and report["notes"] == [doctor.NO_GPU]
    assert report["versions"]["torch"] == torch.__version__ and report["versions"]["gpu"] == "cpu"
    loaded = report["versions"]["cudnn_backend"]  # None for a CPU build of torch: every entry
    assert loaded == environment.versions()["cudnn_backend"] and report["known_issues"] == doctor.known_issues(loaded)
    if loaded is None:
        assert len(report["known_issues"]) == len(errata.ERRATA)


def test_a_model_path_that_does_not_exist_is_one_line_before_any_work(capsys):
    # On a CPU it once gave the normal report, with no word about the model or the path.
    assert launch.main(["doctor", "--model", "/no/such/model"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, (out, err)
    assert err.startswith("cudnn-attention doctor: error: --model /no/such/model: no such file or directory"), err
    assert "pass a checkpoint directory, a config.json or a hub id" in err


@pytest.mark.no_gpu
def test_a_model_the_cpu_cannot_check_is_named_in_the_report(capsys, tmp_path):
    assert launch.main(["doctor", "--json", "--model", str(tmp_path)]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["checks"] == [] and report["notes"][0] == doctor.NO_GPU
    assert report["notes"][1] == f"--model {tmp_path}: not checked ({doctor.NO_GPU})", report["notes"]


def test_self_checks_on_the_cpu_measure_the_exact_path(small):
    checks = doctor.run_self_checks(device="cpu")
    assert [check.name for check in checks] == ["dense", "padded", "packed", "window", "sinks", "packed window sinks"]
    for check in checks:
        assert check.status == "fallback" and check.served_by == "exact path" and check.fallback_reasons == ["cpu tensors"], check
        tensors = {"out", "dq", "dk", "dv"} | ({"dsinks"} if "sinks" in check.name else set())
        assert set(check.measurements) == tensors
        # bfloat16 outputs carry rounding error, within the rule.
        assert all(0 < error <= bound for error, bound in check.measurements.values()), check.measurements
    report = doctor.build_report(device="cpu")
    assert report.exit_status == 1 and "FALLBACK" in report.format()


def served_by_cudnn(corrupt=None):
    """A stand-in for the package's call: the real one (the exact path, on the CPU), reported as served by cuDNN,
    with ``corrupt(name, outputs)`` applied to the outputs first."""
    real = doctor._run_package

    def run(case, inputs):
        outputs, _served_by, _reasons = real(case, inputs)
        if corrupt is not None:
            corrupt(case.name, outputs)
        return outputs, "cuDNN", []

    return run


def test_every_check_passes_when_cudnn_serves_results_within_the_rule(small, monkeypatch):
    monkeypatch.setattr(doctor, "_run_package", served_by_cudnn())
    report = doctor.build_report(device="cpu")
    assert [check.status for check in report.checks] == ["pass"] * 6
    assert report.exit_status == 0 and "6 of 6 checks passed; exit status 0" in report.format()


@pytest.mark.parametrize("corruption", ["offset", "nan"])
def test_a_result_outside_the_rule_fails_its_check_and_the_exit_status(small, monkeypatch, corruption):
    def corrupt(name, outputs):
        if name == "packed":
            outputs["dk"] = outputs["dk"] + 0.05 if corruption == "offset" else outputs["dk"].index_fill(0, torch.tensor([3]), float("nan"))

    monkeypatch.setattr(doctor, "_run_package", served_by_cudnn(corrupt))
    report = doctor.build_report(device="cpu")
    statuses = {check.name: check.status for check in report.checks}
    assert statuses.pop("packed") == "fail" and set(statuses.values()) == {"pass"}
    assert report.exit_status == 1
    failed = next(check for check in report.checks if check.name == "packed")
    assert "dk error" in failed.summary() and "> bound" in failed.summary()


def test_an_error_is_reported_as_its_check(small, monkeypatch):
    def broken(case, inputs):
        raise RuntimeError("cuDNN_STATUS_EXECUTION_FAILED\nmore detail")

    monkeypatch.setattr(doctor, "_run_package", broken)
    report = doctor.build_report(device="cpu")
    assert {check.status for check in report.checks} == {"error"} and report.exit_status == 1
    assert report.checks[0].error == "RuntimeError: cuDNN_STATUS_EXECUTION_FAILED"
    assert json.loads(json.dumps(report.as_dict()))["checks"][0]["passed"] is False


def test_path_taken_reads_the_stats_difference():
    before = {"cudnn_forward": 1, "cudnn_backward": 1, "fallback_forward": {"cpu tensors": 2}, "fallback_backward": {}}
    cudnn = dict(before, cudnn_forward=2, cudnn_backward=2)
    mixed = dict(cudnn, fallback_backward={"float32 inputs": 1})
    assert doctor.path_taken(before, cudnn) == ("cuDNN", [])
    assert doctor.path_taken(before, mixed) == ("mixed", ["float32 inputs"])
    assert doctor.path_taken(before, dict(before, fallback_forward={"cpu tensors": 3})) == ("exact path", ["cpu tensors"])


def tiny_config(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        use_sliding_window=True,
        sliding_window=16,
        max_window_layers=1,
    )
    config.save_pretrained(tmp_path)
    return config


def test_model_check_on_the_cpu(tmp_path):
    tiny_config(tmp_path)
    from cudnn_attention.integrations.hf import doctor_model

    checks = doctor_model.model_checks(str(tmp_path / "config.json"), device=torch.device("cpu"))
    assert [check.name for check in checks] == ["model dense", "model packed"]
    for check in checks:
        assert check.status == "fallback" and check.fallback_reasons == ["cpu tensors"], check
        assert "random weights, 2 layers" in check.note  # one full and one sliding layer of the three
        assert "logits" in check.measurements and all(error <= bound for error, bound in check.measurements.values())


def test_model_check_compares_packed_documents_with_eager_one_document_at_a_time(tmp_path):
    # gpt-oss's eager builds its masks without position_ids (transformers 5.17), so on a packed row it attends across
    # documents where the cuDNN path does not: compared row against row, a correct cuDNN result failed (seen on an H200).
    transformers = pytest.importorskip("transformers")
    from cudnn_attention.integrations.hf import doctor_model

    transformers.GptOssConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=16,
        num_local_experts=2,
        num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"],
    ).save_pretrained(tmp_path)
    checks = doctor_model.model_checks(str(tmp_path), device=torch.device("cpu"))
    assert [(check.name, check.status) for check in checks] == [("model dense", "fallback"), ("model packed", "fallback")], [
        check.summary() for check in checks
    ]


def test_model_check_fails_on_wrong_logits(tmp_path, monkeypatch):
    tiny_config(tmp_path)
    from cudnn_attention.integrations.hf import doctor_model

    real = doctor_model._step

    def step(model, runs, *, keep_on):
        logits, grads = real(model, runs, keep_on=keep_on)
        if model.config._attn_implementation == "cudnn":
            logits = logits + 0.1
        return logits, grads

    monkeypatch.setattr(doctor_model, "_step", step)
    checks = doctor_model.model_checks(str(tmp_path), device=torch.device("cpu"))
    assert [check.status for check in checks] == ["fail", "fail"]
    assert all("logits error" in check.summary() for check in checks)


def test_model_that_cannot_load_is_an_error(tmp_path):
    pytest.importorskip("transformers")
    from cudnn_attention.integrations.hf import doctor_model

    (check,) = doctor_model.model_checks(str(tmp_path / "missing"), device=torch.device("cpu"))
    assert check.name == "model" and check.status == "error" and check.error


@pytest.mark.gpu
def test_gpu_every_check_passes():
    report = doctor.build_report()
    assert report.exit_status == 0, report.format()
    assert report.versions["compute_capability"] and report.versions["cudnn_backend"]


@pytest.mark.gpu
def test_gpu_model_check_passes(tmp_path):
    transformers = pytest.importorskip("transformers")
    from cudnn_attention.integrations.hf import doctor_model

    transformers.MistralConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        sliding_window=64,
    ).save_pretrained(tmp_path)
    checks = doctor_model.model_checks(str(tmp_path), device=torch.device("cuda"))
    assert [(check.name, check.status) for check in checks] == [("model dense", "pass"), ("model packed", "pass")], [
        check.summary() for check in checks
    ]
