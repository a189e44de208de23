"""``kvservice serve`` settings: flags > environment > config file > defaults."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest

from kvservice.cli import build_parser, main
from kvservice.core.errors import InvalidArgumentError
from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.server import event_loop as loop
from kvservice.server.config import ServerConfig, build_manager
from kvservice.server.converters import cache_config_to_pb
from kvservice.server.settings import OPTIONS, SettingsError, load_settings

ROOT = Path(__file__).resolve().parents[2]


def settings_for(argv: list[str], env: dict[str, str], config: Path | None = None) -> object:
    args = build_parser().parse_args(["serve", *argv])
    return load_settings(vars(args), env, args.config or config)


class TestPrecedence:
    def test_defaults_are_the_embedded_pool(self) -> None:
        """No flags, no environment, no file: 127.0.0.1:50051, metrics on 9400."""
        settings = settings_for([], {})
        assert settings.server == ServerConfig()  # type: ignore[attr-defined]
        assert (ServerConfig().host, ServerConfig().port, ServerConfig().metrics_port) == (
            "127.0.0.1",
            50051,
            9400,
        )
        assert settings.log_level == "info"  # type: ignore[attr-defined]

    def test_flags_beat_env_beat_file(self, tmp_path: Path) -> None:
        """Each source overrides the ones below it, key by key."""
        config = tmp_path / "kvservice.toml"
        config.write_text(
            'num_blocks = 100\nblock_size = 32\nmodel_name = "from-file"\n'
            "shutdown_grace = 2\nenable_caching = false\n"
        )
        env = {"KVSERVICE_NUM_BLOCKS": "200", "KVSERVICE_MODEL_NAME": "from-env"}
        settings = settings_for(["--config", str(config), "--model-name", "from-flag"], env).server  # type: ignore[attr-defined]
        assert settings.model_name == "from-flag"
        assert settings.num_blocks == 200
        assert settings.block_size == 32
        assert settings.shutdown_grace_s == 2.0
        assert settings.enable_caching is False
        assert settings.port == 50051

    def test_config_path_from_env_and_booleans(self, tmp_path: Path) -> None:
        """KVSERVICE_CONFIG names the file; booleans parse from env and flags."""
        config = tmp_path / "c.toml"
        config.write_text("zero_new_blocks = true\nmetrics = false\n")
        env = {"KVSERVICE_CONFIG": str(config), "KVSERVICE_ENABLE_CACHING": "off"}
        server = settings_for([], env).server  # type: ignore[attr-defined]
        assert (server.needs_kv_cache_zeroing, server.enable_caching) == (True, False)
        assert server.metrics_port is None  # metrics = false disables the endpoint
        flagged = settings_for(["--enable-caching", "--no-zero-new-blocks"], env)
        assert flagged.server.enable_caching  # type: ignore[attr-defined]
        assert not flagged.server.needs_kv_cache_zeroing  # type: ignore[attr-defined]


class TestBadSettings:
    @pytest.mark.parametrize(
        ("text", "fragment"),
        [
            ("num_blocks = 'many'", "expected int"),
            ("nmu_blocks = 3", "unknown key 'nmu_blocks'"),
            ("num_blocks = [", "config file"),
            ('hash_algo = "md5"', "hash_algo must be one of"),
        ],
    )
    def test_bad_file(self, tmp_path: Path, text: str, fragment: str) -> None:
        config = tmp_path / "bad.toml"
        config.write_text(text)
        with pytest.raises(SettingsError, match=fragment):
            settings_for(["--config", str(config)], {})

    def test_bad_env(self) -> None:
        with pytest.raises(SettingsError, match="KVSERVICE_PORT"):
            settings_for([], {"KVSERVICE_PORT": "http"})
        with pytest.raises(SettingsError, match="KVSERVICE_ENABLE_CACHING"):
            settings_for([], {"KVSERVICE_ENABLE_CACHING": "maybe"})

    def test_missing_file_exits_2(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """main() reports a settings problem in one line, exit code 2."""
        assert main(["serve", "--config", str(tmp_path / "absent.toml")]) == 2
        assert "absent.toml" in capsys.readouterr().err


def test_help_explains_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    """`kvservice serve --help` names every flag with its environment variable, and
    `kvservice --help` lists the command."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for option in OPTIONS:
        assert option.flag in text
        assert option.env in text
    assert "--config" in text
    assert "flags > environment > config file > defaults" in text
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    assert "serve" in capsys.readouterr().out


class TestEventLoop:
    def test_default_is_uvloop_when_installed(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """uvloop when it can be imported, else the standard loop; either can be set."""
        expected = "uvloop" if loop.uvloop_installed() else "asyncio"
        assert settings_for([], {}).event_loop == expected  # type: ignore[attr-defined]
        assert loop.default_event_loop() == expected
        monkeypatch.setattr(loop, "uvloop_installed", lambda: False)
        assert loop.default_event_loop() == "asyncio"
        chosen = settings_for(["--event-loop", "asyncio"], {"KVSERVICE_EVENT_LOOP": "uvloop"})
        assert chosen.event_loop == "asyncio"  # type: ignore[attr-defined]
        assert settings_for([], {"KVSERVICE_EVENT_LOOP": "uvloop"}).event_loop == "uvloop"  # type: ignore[attr-defined]

    def test_unknown_loop_is_refused(self) -> None:
        with pytest.raises(SettingsError, match="event_loop must be one of"):
            settings_for([], {"KVSERVICE_EVENT_LOOP": "trio"})

    def test_factories(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """asyncio: the standard loop (no factory); uvloop: its loop, or a clear error
        when it is not installed."""
        assert loop.loop_factory("asyncio") is None
        if loop.uvloop_installed():
            factory = loop.loop_factory("uvloop")
            assert factory is not None
            event_loop = factory()
            try:
                assert type(event_loop).__module__.startswith("uvloop")
            finally:
                event_loop.close()
        monkeypatch.setattr(loop, "uvloop_installed", lambda: False)
        with pytest.raises(ValueError, match="pip install"):
            loop.loop_factory("uvloop")


class TestOperatorSurface:
    """What an operator used to vLLM and to other servers expects of the command line."""

    def test_metrics_port_zero_is_any_free_port_and_no_metrics_disables(self) -> None:
        """--metrics-port 0 means any free port, as --port 0 does; the endpoint is
        turned off by --no-metrics (KVSERVICE_METRICS=0, metrics = false)."""
        assert settings_for(["--metrics-port", "0"], {}).server.metrics_port == 0  # type: ignore[attr-defined]
        assert settings_for(["--no-metrics"], {}).server.metrics_port is None  # type: ignore[attr-defined]
        assert settings_for([], {"KVSERVICE_METRICS": "0"}).server.metrics_port is None  # type: ignore[attr-defined]
        assert settings_for(["--metrics"], {"KVSERVICE_METRICS": "0"}).server.metrics_port == 9400  # type: ignore[attr-defined]

    def test_ports_outside_the_tcp_range_are_refused(self) -> None:
        with pytest.raises(SettingsError, match="port must be between 0 and 65535"):
            settings_for(["--port", "70000"], {})
        with pytest.raises(SettingsError, match="metrics_port must be between 0 and 65535"):
            settings_for([], {"KVSERVICE_METRICS_PORT": "-1"})

    def test_vllm_flag_names_are_accepted(self) -> None:
        """vLLM's names for the same settings work as aliases of serve's own."""
        server = settings_for(
            [
                "--no-enable-prefix-caching",
                "--prefix-caching-hash-algo",
                "xxhash",
                "--num-gpu-blocks-override",
                "1234",
                "--block-size",
                "32",
                "--max-model-len",
                "4096",
                "--gpu-memory-utilization",
                "0.5",
            ],
            {},
        ).server  # type: ignore[attr-defined]
        assert server.enable_caching is False
        assert server.hash_algo == "xxhash"
        assert server.num_blocks == 1234
        assert (server.block_size, server.max_model_len) == (32, 4096)
        assert server.gpu_memory_utilization == 0.5
        assert settings_for(["--enable-prefix-caching"], {}).server.enable_caching  # type: ignore[attr-defined]

    def test_max_in_flight_tokens_bounds_the_window_at_admission(self) -> None:
        """--max-in-flight-tokens is vLLM's max_in_flight_tokens: a sliding-window group
        is counted for at most its window plus it at admission (max_model_len unless
        given, as vLLM's manager), and GetCacheConfig reports both."""
        pool = ["--sliding-window", "256", "--max-model-len", "2048", "--num-blocks", "300"]
        cases: list[tuple[list[str], int, int]] = [
            ([], 2048, 129),
            (["--max-in-flight-tokens", "512"], 512, 49),
        ]
        for flags, in_flight, cap in cases:
            server = settings_for([*pool, *flags], {}).server  # type: ignore[attr-defined]
            response = cache_config_to_pb(build_manager(server), "m")
            full, window = response.groups
            assert not full.HasField("max_admission_blocks_per_request")
            assert (response.max_in_flight_tokens, window.max_admission_blocks_per_request) == (
                in_flight,
                cap,
            )
        with pytest.raises(InvalidArgumentError, match="max_in_flight_tokens must be >= 0"):
            build_manager(dataclasses.replace(server, max_in_flight_tokens=-1))

    def test_help_lists_the_allowed_values(self, capsys: pytest.CaptureFixture[str]) -> None:
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--help"])
        text = " ".join(capsys.readouterr().out.split())
        for allowed in (
            "one of: sha256, sha256_cbor, xxhash, xxhash_cbor",
            "one of: cpu, cuda",
            "one of: none, torch",
        ):
            assert allowed in text

    def test_version(self, capsys: pytest.CaptureFixture[str]) -> None:
        """`kvservice --version` prints the installed version, the one pyproject.toml
        declares."""
        with pytest.raises(SystemExit) as exited:
            main(["--version"])
        assert exited.value.code == 0
        declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
        assert capsys.readouterr().out.strip() == f"kvservice {declared}"


class TestKVCacheGroups:
    """``--kv-cache-groups`` lays out the groups vLLM computed, and
    ``--max-num-batched-tokens`` makes the pool check vLLM's."""

    def test_a_window_on_every_layer_is_one_group(self) -> None:
        server = settings_for(
            [
                "--kv-cache-groups",
                "sliding_window:64",
                "--num-blocks",
                "24",
                "--max-model-len",
                "256",
            ],
            {},
        ).server  # type: ignore[attr-defined]
        response = cache_config_to_pb(build_manager(server), "m")
        [group] = response.groups
        assert (group.kind, group.sliding_window) == (pb.KV_CACHE_SPEC_KIND_SLIDING_WINDOW, 64)

    def test_hybrid_groups_in_vllm_order(self) -> None:
        flags = ["--kv-cache-groups", "sliding_window:32,full_attention,mamba:16"]
        flags += ["--num-blocks", "200", "--max-model-len", "512"]
        server = settings_for(flags, {}).server  # type: ignore[attr-defined]
        groups = build_manager(server).kv_cache_config.kv_cache_groups
        assert [g.kv_cache_spec.kind.value for g in groups] == [
            "sliding_window",
            "full_attention",
            "mamba",
        ]
        assert len({g.kv_cache_spec.page_size_bytes for g in groups}) == 1

    def test_the_options_they_replace_are_refused_beside_them(self) -> None:
        for extra in (["--sliding-window", "64"], ["--mamba-block-size", "16"]):
            server = settings_for(["--kv-cache-groups", "full_attention", *extra], {}).server  # type: ignore[attr-defined]
            with pytest.raises(
                InvalidArgumentError, match="names every group: drop --sliding-window"
            ):
                build_manager(server)
        server = settings_for(["--kv-cache-groups", "full,window"], {}).server  # type: ignore[attr-defined]
        with pytest.raises(InvalidArgumentError, match="unknown kind 'full'"):
            build_manager(server)

    def test_max_num_batched_tokens_accepts_the_pool_vllm_accepts(self) -> None:
        """Full attention beside a 256-token window, 16-token blocks, max_model_len
        2048: vLLM fits one request in 256 blocks with 512 batched tokens (128 + 49),
        the server without knowing them counts a window of max_model_len (128 + 129)."""
        pool = [
            "--kv-cache-groups",
            "full_attention,sliding_window:256",
            "--max-model-len",
            "2048",
            "--num-blocks",
            "256",
        ]
        refused = settings_for(pool, {}).server  # type: ignore[attr-defined]
        with pytest.raises(InvalidArgumentError, match="257 blocks are needed") as info:
            build_manager(refused)
        assert "--max-num-batched-tokens" in str(info.value)
        accepted = settings_for([*pool, "--max-num-batched-tokens", "512"], {}).server  # type: ignore[attr-defined]
        response = cache_config_to_pb(build_manager(accepted), "m")
        assert response.max_in_flight_tokens == 512
        assert response.groups[1].max_admission_blocks_per_request == 49
        both = settings_for(
            [*pool, "--max-num-batched-tokens", "512", "--max-in-flight-tokens", "1024"], {}
        ).server  # type: ignore[attr-defined]
        assert cache_config_to_pb(build_manager(both), "m").max_in_flight_tokens == 1024
