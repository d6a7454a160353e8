"""Cluster configs: the shipped toy config loads; mistakes are one-line ConfigErrors."""

from __future__ import annotations

import re

import pytest

from prfaas_jax.engine.host_memory import KEEP_BYTES
from prfaas_jax.errors import ConfigError
from prfaas_jax.policy.routing import Role
from prfaas_jax.serving.cluster_config import instance_roles, load_cluster_config, local_devices


def test_toy_config():
    config = load_cluster_config("toy")
    assert config.model.preset == "recall-tiny" and config.model.engine == "jax"
    assert config.router.threshold == 64 and config.engine.max_len == 4096
    assert config.link.bandwidth_bytes_per_s == 2e6
    assert instance_roles(config) == {
        "prfaas-0": Role.PRFAAS_PREFILL,
        "pd-0": Role.PD_PREFILL,
        "pd-1": Role.PD_DECODE,
    }
    candidates = config.controller_config().candidates
    assert candidates[0] == 16 and candidates[-1] == 4096
    cache = config.prefix_cache
    assert cache.enabled and cache.capacity_bytes == 64 * 2**20
    assert (cache.block_size, cache.checkpoint_every) == (16, 4)


def write(tmp_path, text: str):
    path = tmp_path / "cluster.toml"
    path.write_text('[model]\npreset = "tiny"\n' + text)
    return path


def test_defaults_and_policy_keys(tmp_path):
    config = load_cluster_config(
        write(
            tmp_path,
            "[controller]\nhigh_utilization = 0.9\nmin_samples = 3\n"
            "[rebalancer]\nenabled = true\nconsecutive = 3\n"
            "[link]\nschedule = [[10, 0.1], [20, 1]]\nrepeat_s = 30\n",
        )
    )
    assert config.controller_config().high_utilization == 0.9
    assert config.controller_config().min_samples == 3
    assert config.rebalancer.enabled and config.rebalancer.config.consecutive == 3
    assert config.link.schedule == ((10.0, 0.1), (20.0, 1.0))
    assert not config.prefix_cache.enabled  # off unless a config turns it on


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[router]\nthreshhold = 3\n", "router.threshhold: unknown key"),
        ("[routers]\n", "routers: unknown key (expected one of: model, engine"),
        ("[router]\nthreshold = 'high'\n", 'router.threshold: expected a number, got "high"'),
        ("[engine]\nmax_slots = 0\n", "engine.max_slots: must be ≥ 1"),
        ("[engine]\nallocator = 'pages'\n", "engine.allocator"),
        ("[engine]\nblock_size = 0\n", "engine.block_size: must be ≥ 1"),
        (
            "[engine]\nallocator = 'paged'\ndecode_mesh = 'tensor=2'\n",
            "engine.decode_mesh: the paged decode engine runs on one device",
        ),
        ("[instances]\npd_decode = 0\n", "instances.pd_decode: must be ≥ 1"),
        ("[link]\nschedule = [[2, 1], [1, 1]]\n", "link.schedule: must be"),
        ("[controller]\nlow_utilization = 0.95\n", "low_utilization"),
        ("[rebalancer]\nimbalance = 0.5\n", "imbalance"),
        ("[model]\n", "invalid TOML"),
        ("[prefix_cache]\nblock_sise = 8\n", "prefix_cache.block_sise: unknown key"),
        ("[prefix_cache]\nenabled = 1\n", "prefix_cache.enabled: expected true or false, got 1"),
        ("[prefix_cache]\ncheckpoint_every = 0\n", "prefix_cache.checkpoint_every: must be ≥ 1"),
        ("[prefix_cache]\ncapacity_mib = -1\n", "prefix_cache.capacity_mib: must be ≥ 0"),
    ],
)
def test_mistakes(tmp_path, text, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_cluster_config(write(tmp_path, text))


@pytest.mark.parametrize("impl", ["reference", "chunk", "pallas"])
def test_every_impl_is_served(tmp_path, impl):
    """Pallas included: interpreted on a machine without an accelerator, compiled on one."""
    path = tmp_path / "c.toml"
    path.write_text(f'[model]\npreset = "tiny"\nimpl = "{impl}"\n')
    assert load_cluster_config(path).model.impl == impl
    path.write_text('[model]\npreset = "tiny"\nimpl = "triton"\n')
    with pytest.raises(ConfigError, match=r"model\.impl"):
        load_cluster_config(path)


def test_missing_file_and_preset(tmp_path):
    with pytest.raises(ConfigError, match="cannot read cluster config"):
        load_cluster_config(tmp_path / "absent.toml")
    path = tmp_path / "c.toml"
    path.write_text("[model]\nseed = 1\n")
    with pytest.raises(ConfigError, match=r"model\.preset: missing key"):
        load_cluster_config(path)


def test_overload_keys(tmp_path):
    defaults = load_cluster_config(write(tmp_path, ""))
    assert (defaults.router.max_in_flight, defaults.router.ttft_slo_s) == (256, 0.0)
    assert defaults.engine.max_prefill_queue == 64
    assert defaults.pending_states_limit == 256  # 0: as many as the router admits
    config = load_cluster_config(
        write(
            tmp_path,
            "[engine]\nmax_prefill_queue = 3\nmax_pending_states = 5\n"
            "[router]\nmax_in_flight = 7\nttft_slo_s = 1.5\n",
        )
    )
    assert (config.router.max_in_flight, config.router.ttft_slo_s) == (7, 1.5)
    assert (config.engine.max_prefill_queue, config.pending_states_limit) == (3, 5)
    for text, message in [
        ("[router]\nmax_in_flight = 0\n", "router.max_in_flight: must be ≥ 1"),
        ("[router]\nttft_slo_s = -1\n", "router.ttft_slo_s: must be ≥ 0"),
        ("[engine]\nmax_prefill_queue = 0\n", "engine.max_prefill_queue: must be ≥ 1"),
        ("[engine]\nmax_pending_states = -1\n", "engine.max_pending_states: must be ≥ 0"),
        ("[engine]\nmax_pending_states = 2.5\n", "engine.max_pending_states: expected an integer"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_cluster_config(write(tmp_path, text))


MESH = '[engine]\nprefill_mesh = "tensor=4"\n'


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[instances]\nprfaas_processes = 0\n", "instances.prfaas_processes: must be ≥ 1"),
        (
            "[instances]\nprfaas_processes = 2\n",
            "instances.prfaas_processes: 2 processes need [engine] prfaas_mesh (or prefill_mesh)",
        ),
        (
            '[engine]\nprefill_mesh = "tensor=3"\n[instances]\nprfaas_processes = 2\n',
            "tensor=3 does not",
        ),
        (
            MESH + "[instances]\nprfaas_processes = 2\n[prefix_cache]\nenabled = true\n",
            "instances.prfaas_processes: needs [prefix_cache] enabled = false",
        ),
        (
            MESH + '[instances]\nprfaas_processes = 2\n[model]\nengine = "fake"\n',
            'needs [model] engine = "jax"',
        ),
        ('[engine]\ndecode_mesh = "tensors=2"\n', "engine.decode_mesh: bad mesh entry"),
    ],
)
def test_multiprocess_mistakes(tmp_path, text, message):
    if "[model]" in text:  # a second [model] table: fold it into the first
        path = tmp_path / "cluster.toml"
        path.write_text(text.replace("[model]\n", '[model]\npreset = "tiny"\n'))
    else:
        path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_cluster_config(path)


def test_local_devices_per_process(tmp_path):
    """A multi-process PrfaaS instance splits prefill_mesh evenly; a PD node holds enough for
    either of its meshes; no mesh, one device."""
    config = load_cluster_config(
        write(
            tmp_path,
            '[engine]\nprefill_mesh = "tensor=2,data=2"\ndecode_mesh = "tensor=8"\n'
            "[instances]\nprfaas_processes = 2\n",
        )
    )
    assert local_devices(config, Role.PRFAAS_PREFILL) == 2
    assert local_devices(config, Role.PD_PREFILL) == local_devices(config, Role.PD_DECODE) == 8
    assert local_devices(load_cluster_config(write(tmp_path, "")), Role.PD_DECODE) == 1
    shipped = load_cluster_config("multiprocess")
    assert shipped.instances.prfaas_processes == 2
    assert local_devices(shipped, Role.PRFAAS_PREFILL) == 2
    # prfaas_mesh is the PrfaaS instances' own: the PD nodes keep one device.
    assert local_devices(shipped, Role.PD_PREFILL) == 1
    assert shipped.engine.prfaas_prefill_mesh == "tensor=4" and shipped.engine.prefill_mesh == ""


def test_hosts(tmp_path):
    config = load_cluster_config(
        write(
            tmp_path,
            "[instances]\nprfaas_prefill = 2\npd_prefill = 1\npd_decode = 2\n"
            '[hosts]\nrouter = "10.0.0.2:50050"\nprfaas = "10.0.0.1:50100"\n'
            'pd = "10.0.0.2"\n"pd-2" = "10.0.0.3:50300"\n',
        )
    )
    hosts = config.hosts
    assert [str(hosts.endpoint(n)) for n in ("router", "prfaas-0", "prfaas-1")] == [
        "10.0.0.2:50050",
        "10.0.0.1:50100",
        "10.0.0.1:50101",  # instance i at PORT + i
    ]
    assert [str(hosts.endpoint(n)) for n in ("pd-0", "pd-1", "pd-2")] == [
        "10.0.0.2:0",  # no port: a free one
        "10.0.0.2:0",
        "10.0.0.3:50300",  # its own entry
    ]
    defaults = load_cluster_config(write(tmp_path, "")).hosts
    assert str(defaults.endpoint("pd-1")) == str(defaults.endpoint("router")) == "127.0.0.1:0"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[hosts]\nrouters = "a"\n', "hosts.routers: unknown key (expected router, prfaas, pd"),
        ('[hosts]\n"pd-7" = "a"\n', "hosts.pd-7: unknown key"),
        ("[hosts]\npd = 5\n", "hosts.pd: expected a string HOST or HOST:PORT, got 5"),
        ('[hosts]\npd = "10.0.0.1:http"\n', "hosts.pd: expected HOST or HOST:PORT"),
        ('[hosts]\npd = "10.0.0.1:70000"\n', "hosts.pd: expected HOST or HOST:PORT"),
        ('[hosts]\npd = ":5"\n', "hosts.pd: expected HOST or HOST:PORT"),
        ('[hosts]\npd = "::1"\n', "hosts.pd: expected HOST or HOST:PORT"),
        (
            '[hosts]\nprfaas = "h:5000"\npd = "h:4999"\n',
            "hosts: prfaas-0 and pd-1 would both listen on h:5000",
        ),
        ('[hosts]\nrouter = "h:80"\n"pd-0" = "h:80"\n', "router and pd-0 would both listen"),
    ],
)
def test_hosts_mistakes(tmp_path, text, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_cluster_config(write(tmp_path, text))


def test_state_pool_key(tmp_path):
    default = load_cluster_config(write(tmp_path, "")).engine.state_pool_mib
    assert default == KEEP_BYTES / 2**20 == 4096  # the pool's own default
    config = load_cluster_config(write(tmp_path, "[engine]\nstate_pool_mib = 512\n"))
    assert config.engine.state_pool_mib == 512
    with pytest.raises(ConfigError, match=re.escape("engine.state_pool_mib: must be ≥ 0")):
        load_cluster_config(write(tmp_path, "[engine]\nstate_pool_mib = -1\n"))
