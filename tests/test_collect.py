"""inv collect's pure parts: what is redacted (and what is not), how a long text is cut, and the
NCCL verdicts read back from the collected logs."""

from railyard.verbs.collect import _nccl_verdicts, _tail, redact

from .conftest import FIXTURES


def test_secret_named_values_are_redacted_and_the_rest_is_kept():
    text = ('VLLM_API_KEY=abc123def456\nHF_TOKEN=hf_live_0123456789\nNCCL_IB_HCA=mlx5_1\n'
            '"Env": ["PATH=/usr/bin","LITELLM_MASTER_KEY=sk-zzzzzzzzzzzz","VLLM_HOST_IP=192.168.101.1"]\n'
            'curl -H "Authorization: Bearer sk-0123456789abcdef" http://127.0.0.1:4000\n')
    out = redact(text)
    for secret in ("abc123def456", "hf_live_0123456789", "sk-zzzzzzzzzzzz", "sk-0123456789abcdef"):
        assert secret not in out
    assert "NCCL_IB_HCA=mlx5_1" in out and '"VLLM_HOST_IP=192.168.101.1"' in out and '"PATH=/usr/bin"' in out
    assert "VLLM_API_KEY=<redacted>" in out and '"LITELLM_MASTER_KEY=<redacted>"' in out


def test_a_long_text_keeps_its_tail_and_says_what_was_cut():
    text = "".join(f"line {i}\n" for i in range(100_000))
    cut = _tail(text, 1000)
    assert cut.startswith("[railyard collect: the first ") and cut.endswith("line 99999\n")
    assert len(cut.encode()) < 1100 and _tail("short\n", 1000) == "short\n"


def test_collected_nccl_logs_are_judged_per_file():
    # a real NCCL 2.28.9 log (tests/fixtures/real/nccl/ORIGINS-h200.md), as `inv collect` brings it back
    body = (FIXTURES / "real" / "nccl" / "h200-two-hosts-one-gpu_default_nccl2.28.9_r0.log").read_text()
    verdicts = _nccl_verdicts({"A": {"head.nccl": f"@@file /tmp/nccl_A_1.log\n{body}", "head.log": "x"}})
    assert len(verdicts) == 1 and verdicts[0]["source"] == "A:/tmp/nccl_A_1.log"
    assert verdicts[0]["nccl_version"].startswith("2.28.9")
