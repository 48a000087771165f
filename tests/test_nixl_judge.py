"""The NIXL judge (railyard.checks.nixl) on UCX's endpoint lines: RDMA on a rail HCA passes, TCP or an
off-rail device fails, no endpoint at all is never a pass."""

from railyard.checks.nixl import judge

from .conftest import FIXTURES

REAL = (FIXTURES / "real" / "ucx" / "inter-node-rc.log").read_text()
HCAS = ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
TCP = ("(EngineCore_DP0 pid=51) [1764583211.104] [D1:51:a]      ucp_worker.c:1903 UCX  INFO    ucp_context_0 "
       "inter-node cfg#1 rma_am(tcp/enp24s0np0) am(tcp/enp24s0np0) ka(tcp/enp24s0np0)")


def test_a_real_inter_node_endpoint_over_rc_mlx5_on_the_rails_passes():
    v = judge("D1:decode", REAL, HCAS, "mlx5_0:1,mlx5_1:1")
    assert v.verdict == "pass" and v.transport == "rdma" and v.devices == ["mlx5_0:1", "mlx5_1:1", "mlx5_2:1",
                                                                           "mlx5_3:1"]


def test_tcp_an_off_rail_hca_or_no_endpoint_fail():
    tcp = judge("D1:decode", TCP, HCAS, "mlx5_0:1")
    assert tcp.verdict == "fail" and tcp.transport == "tcp" and "over TCP (enp24s0np0)" in tcp.reasons[0]
    off = judge("D1:decode", REAL, ["mlx5_0", "mlx5_1"], "mlx5_0:1")
    assert off.verdict == "fail" and "mlx5_2:1, mlx5_3:1, which is not a rail HCA" in off.reasons[0]
    none = judge("D1:decode", "(APIServer pid=1) INFO Application startup complete.", HCAS, "mlx5_0:1")
    assert none.verdict == "fail" and "no UCX inter-node endpoint" in none.reasons[0]
    unset = judge("D1:decode", REAL, HCAS, None)
    assert unset.verdict == "fail" and "UCX_NET_DEVICES is not set" in unset.reasons[0]


def test_a_nixl_backend_error_fails_even_beside_an_rdma_endpoint():
    err = judge("P1:prefill", REAL + "nixl._bindings.nixlBackendError: NIXL_ERR_BACKEND\n", HCAS, "mlx5_0:1")
    assert err.verdict == "fail" and "NIXL_ERR_BACKEND" in err.reasons[0]
