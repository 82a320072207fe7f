"""The simulator's `vllm serve` flags: accepted and refused as each imitated release does."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import read_page
from vkvagent.sim.serve_args import (
    FLAVOR_VERSIONS,
    GIB_BYTES,
    ServeArgs,
    ServeArgsError,
    cache_config_labels,
    known_options,
    main_error,
    parse_serve_args,
    resolve_for_model,
)

FLAVORS = tuple(FLAVOR_VERSIONS)
V1 = ("v1-0.8", "v1-0.10", "v1-latest")
M = "meta-llama/Llama-3.1-8B-Instruct"


def parse(flavor: str, *argv: str, entrypoint: str = "auto") -> ServeArgs:
    return parse_serve_args(list(argv), flavor, entrypoint=entrypoint)


def refused(flavor: str, *argv: str, entrypoint: str = "auto") -> ServeArgsError:
    with pytest.raises(ServeArgsError) as info:
        parse_serve_args(list(argv), flavor, entrypoint=entrypoint)
    return info.value


def usage_error(flavor: str, *argv: str, entrypoint: str = "auto") -> str:
    """The message of an argparse refusal (exit status 2)."""
    err = refused(flavor, *argv, entrypoint=entrypoint)
    assert err.exit_code == 2, err.render()
    assert err.exc_type == "argparse"
    return err.message


def config_error(flavor: str, *argv: str, entrypoint: str = "auto") -> str:
    """The message of an engine-config refusal (a traceback, exit status 1)."""
    err = refused(flavor, *argv, entrypoint=entrypoint)
    assert err.exit_code == 1, err.render()
    return err.message


# ------------------------------------------------------------------------------------------
# Flavours and defaults


def test_each_flavour_names_the_vllm_release_it_imitates() -> None:
    assert FLAVOR_VERSIONS == {
        "v0": "0.6.6",
        "v1-0.8": "0.8.5",
        "v1-0.10": "0.10.1",
        "v1-latest": "0.32.0",
    }


def test_unknown_flavour_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="flavour"):
        parse_serve_args([M], "v2")
    with pytest.raises(ValueError, match="entrypoint"):
        parse_serve_args([M], "v0", entrypoint="python")


@pytest.mark.parametrize(
    ("flavor", "expected"),
    [
        (
            "v0",
            dict(
                gpu_memory_utilization=0.9,
                enable_prefix_caching=False,
                prefix_caching_hash_algo=None,
                max_num_seqs=256,
                max_num_batched_tokens=None,  # max(max_model_len, 2048): see resolve_for_model
                enable_chunked_prefill=None,  # on above 32K tokens of context
                swap_space=4,
                shutdown_timeout=None,
                seed=0,
            ),
        ),
        (
            "v1-0.8",
            dict(
                gpu_memory_utilization=0.9,
                enable_prefix_caching=True,
                prefix_caching_hash_algo="builtin",
                max_num_seqs=1024,
                max_num_batched_tokens=8192,
                enable_chunked_prefill=True,
                swap_space=4,
                shutdown_timeout=None,
                seed=None,
            ),
        ),
        (
            "v1-0.10",
            dict(
                gpu_memory_utilization=0.9,
                enable_prefix_caching=True,
                prefix_caching_hash_algo="builtin",
                max_num_seqs=1024,
                max_num_batched_tokens=8192,
                enable_chunked_prefill=True,
                swap_space=4,
                shutdown_timeout=None,
                seed=None,
            ),
        ),
        (
            "v1-latest",
            dict(
                gpu_memory_utilization=0.92,
                enable_prefix_caching=True,
                prefix_caching_hash_algo="sha256",
                max_num_seqs=1024,
                max_num_batched_tokens=8192,
                enable_chunked_prefill=True,
                swap_space=None,
                shutdown_timeout=0,
                seed=0,
            ),
        ),
    ],
)
def test_defaults_per_flavour(flavor: str, expected: dict[str, object]) -> None:
    args = parse(flavor, M)
    for name, value in expected.items():
        assert getattr(args, name) == value, name
    assert args.model == M
    assert args.served_model_name == M and args.served_model_names == (M,)
    assert (args.host, args.port) == ("0.0.0.0", 8000)
    assert args.block_size == 16
    assert args.kv_cache_dtype == "auto" and args.dtype == "auto"
    assert args.max_model_len is None
    assert args.enforce_eager is False and args.trust_remote_code is False
    assert args.tensor_parallel_size == args.data_parallel_size == args.api_server_count == 1
    assert args.cpu_offload_gb == 0 and args.num_gpu_blocks_override is None
    assert args.preemption_mode is None
    assert args.explicit == frozenset()


# ------------------------------------------------------------------------------------------
# Syntax


@pytest.mark.parametrize("flavor", FLAVORS)
def test_positional_model_and_flags_in_both_forms(flavor: str) -> None:
    spaced = parse(flavor, M, "--max-num-seqs", "64", "--gpu-memory-utilization", "0.8")
    joined = parse(flavor, M, "--max-num-seqs=64", "--gpu-memory-utilization=0.8")
    assert spaced == joined
    assert spaced.max_num_seqs == 64 and spaced.gpu_memory_utilization == 0.8
    assert spaced.explicit == {"max_num_seqs", "gpu_memory_utilization"}


@pytest.mark.parametrize("flavor", FLAVORS)
def test_api_server_form_takes_model_as_an_option(flavor: str) -> None:
    for entrypoint in ("auto", "api_server"):
        args = parse(flavor, "--model", M, "--port", "8001", entrypoint=entrypoint)
        assert (args.model, args.port) == (M, 8001)
        assert parse(flavor, f"--model={M}", entrypoint=entrypoint).model == M
    assert usage_error(flavor, "--port", "8001", entrypoint="api_server") == (
        "the following arguments are required: --model"
    )
    assert usage_error(flavor, M, "--model", M, entrypoint="api_server") == (
        f"unrecognized arguments: {M}"
    )


@pytest.mark.parametrize("flavor", V1)
def test_vllm_serve_moves_model_option_to_the_front_from_0_8(flavor: str) -> None:
    args = parse(flavor, "-tp", "2", "--model", M, "--enforce-eager", entrypoint="serve")
    assert (args.model, args.tensor_parallel_size, args.enforce_eager) == (M, 2, True)
    # Both a positional model and --model: the positional one is left over.
    assert usage_error(flavor, "other/model", "--model", M) == (
        "unrecognized arguments: other/model"
    )
    assert usage_error(flavor, M, "--model") == "argument --model: expected one argument"


def test_vllm_serve_0_6_wants_the_model_positional() -> None:
    assert usage_error("v0", "--model", M, entrypoint="serve") == (
        "the following arguments are required: model_tag"
    )
    assert config_error("v0", M, "--model", M) == (
        "With `vllm serve`, you should provide the model as a positional argument "
        "instead of via the `--model` option."
    )


def test_served_model_name_without_positional_model_in_latest_vllm_serve() -> None:
    err = refused("v1-latest", "--served-model-name", "chat", "--port", "8001", entrypoint="serve")
    assert err.exit_code == 1 and err.exc_type == "ValueError"
    assert "`model` should be provided as the first positional argument" in err.message
    # With the model first, any number of served names; the first names the metrics.
    args = parse("v1-latest", M, "--served-model-name", "chat", "chat-2", "--port", "8001")
    assert args.served_model_names == ("chat", "chat-2") and args.served_model_name == "chat"


@pytest.mark.parametrize("flavor", FLAVORS)
def test_underscores_in_names_are_dashes_values_untouched(flavor: str) -> None:
    dashed = parse(flavor, M, "--max-num-seqs", "64", "--served-model-name", "my_model")
    assert parse(flavor, M, "--max_num_seqs", "64", "--served_model_name", "my_model") == dashed
    assert parse(flavor, M, "--max_num_seqs=64", "--served_model_name=my_model") == dashed
    assert dashed.served_model_name == "my_model"
    assert parse(flavor, M, "--kv_cache_dtype=fp8_e5m2").kv_cache_dtype == "fp8_e5m2"
    assert parse(flavor, M, "--no_enable_prefix_caching").enable_prefix_caching is False
    # A model name with underscores is a value, never rewritten.
    assert parse(flavor, "org/my_model").model == "org/my_model"


@pytest.mark.parametrize("flavor", FLAVORS)
def test_repeated_flags_last_one_wins(flavor: str) -> None:
    args = parse(flavor, M, "--max-num-seqs", "64", "--max_num_seqs=32", "--block-size", "32")
    assert args.max_num_seqs == 32 and args.block_size == 32
    flip = parse(flavor, M, "--enable-prefix-caching", "--no-enable-prefix-caching")
    assert flip.enable_prefix_caching is False
    assert parse(
        flavor, M, "--no-enable-prefix-caching", "--enable-prefix-caching"
    ).enable_prefix_caching


@pytest.mark.parametrize("flavor", FLAVORS)
def test_short_options_and_negative_numbers(flavor: str) -> None:
    args = parse(flavor, M, "-tp", "4", "-pp=2", "--seed", "-1")
    assert (args.tensor_parallel_size, args.pipeline_parallel_size, args.seed) == (4, 2, -1)
    assert usage_error(flavor, M, "-tp4") == "unrecognized arguments: -tp4"


def test_boolean_pairs_where_the_release_has_them() -> None:
    # --enable-prefix-caching is BooleanOptionalAction since 0.6.5 (PR #10724).
    for flavor in FLAVORS:
        assert parse(flavor, M, "--enable-prefix-caching").enable_prefix_caching is True
        assert parse(flavor, M, "--no-enable-prefix-caching").enable_prefix_caching is False
    # ModelConfig flags became --x/--no-x pairs with the 0.9 config dataclasses.
    for flavor in ("v0", "v1-0.8"):
        assert parse(flavor, M, "--enforce-eager", "--trust-remote-code").enforce_eager
        assert usage_error(flavor, M, "--no-enforce-eager") == (
            "unrecognized arguments: --no-enforce-eager"
        )
        assert usage_error(flavor, M, "--enforce-eager=true") == (
            "argument --enforce-eager: ignored explicit argument 'true'"
        )
    for flavor in ("v1-0.10", "v1-latest"):
        args = parse(flavor, M, "--enforce-eager", "--no-enforce-eager", "--no-trust-remote-code")
        assert args.enforce_eager is False and args.trust_remote_code is False
        assert usage_error(flavor, M, "--enforce-eager=true") == (
            "argument --enforce-eager/--no-enforce-eager: ignored explicit argument 'true'"
        )
    assert parse("v1-latest", M, "--disable-log-stats").disable_log_stats is True
    assert usage_error("v1-latest", M, "--no-disable-log-stats") == (
        "unrecognized arguments: --no-disable-log-stats"
    )


def test_v0_chunked_prefill_takes_an_optional_true_or_false() -> None:
    assert parse("v0", M, "--enable-chunked-prefill").enable_chunked_prefill is True
    assert parse("v0", M, "--enable-chunked-prefill=False").enable_chunked_prefill is False
    assert parse("v0", M, "--enable-chunked-prefill", "false").enable_chunked_prefill is False
    args = parse("v0", M, "--enable-chunked-prefill", "--max-num-seqs", "8")
    assert args.enable_chunked_prefill is True and args.max_num_seqs == 8
    assert config_error("v0", M, "--enable-chunked-prefill", "yes") == (
        "Invalid boolean value: yes. Expected 'true' or 'false'."
    )
    assert usage_error("v0", M, "--no-enable-chunked-prefill") == (
        "unrecognized arguments: --no-enable-chunked-prefill"
    )


def test_v1_chunked_prefill_pair_is_ignored_until_latest() -> None:
    for flavor in ("v1-0.8", "v1-0.10"):  # "V1 always uses chunked prefill"
        assert parse(flavor, M, "--no-enable-chunked-prefill").enable_chunked_prefill is True
    assert parse("v1-latest", M, "--no-enable-chunked-prefill").enable_chunked_prefill is False


@pytest.mark.parametrize(
    ("text", "value"),
    [("32k", 32000), ("32K", 32768), ("1m", 10**6), ("1M", 2**20), ("1G", 2**30),
     ("25.6k", 25600), ("1t", 10**12), ("1T", 2**40), ("4096", 4096), (" 2k ", 2000)],
)  # fmt: skip
def test_human_readable_integers_in_latest(text: str, value: int) -> None:
    args = parse("v1-latest", M, "--max-model-len", text, "--max-num-batched-tokens", text)
    assert args.max_model_len == value and args.max_num_batched_tokens == value


def test_human_readable_integers_by_release() -> None:
    assert usage_error("v1-latest", M, "--max-model-len", "1.5K") == (
        "argument --max-model-len: Decimals are not allowed with binary suffixes like K. "
        "Did you mean to use 1.5k instead?"
    )
    assert usage_error("v1-latest", M, "--max-model-len", "32kb") == (
        "argument --max-model-len: invalid human_readable_int_or_auto value: '32kb'"
    )
    assert parse("v1-latest", M, "--max-model-len", "auto").max_model_len == -1
    assert parse("v1-latest", M, "--max-model-len", "-1").max_model_len == -1
    assert (
        parse("v1-latest", M, "--kv-cache-memory-bytes", "20G").kv_cache_memory_bytes == 20 * 2**30
    )
    # 0.8/0.10: --max-model-len only, and without the 't' multipliers.
    for flavor in ("v1-0.8", "v1-0.10"):
        assert parse(flavor, M, "--max-model-len", "32K").max_model_len == 32768
        assert usage_error(flavor, M, "--max-model-len", "1t") == (
            "argument --max-model-len: invalid human_readable_int value: '1t'"
        )
        assert usage_error(flavor, M, "--max-num-batched-tokens", "8k") == (
            "argument --max-num-batched-tokens: invalid int value: '8k'"
        )
    assert usage_error("v0", M, "--max-model-len", "32k") == (
        "argument --max-model-len: invalid int value: '32k'"
    )


# ------------------------------------------------------------------------------------------
# Refusals


@pytest.mark.parametrize("flavor", FLAVORS)
def test_unknown_flags_are_unrecognized_arguments(flavor: str) -> None:
    assert usage_error(flavor, M, "--foo") == "unrecognized arguments: --foo"
    assert usage_error(flavor, M, "--foo", "bar", "--port", "1") == (
        "unrecognized arguments: --foo bar"
    )
    assert usage_error(flavor, M, "--foo_bar=1", "extra") == (
        "unrecognized arguments: --foo-bar=1 extra"
    )
    # argparse's abbreviations are refused: the simulator is never looser than vLLM.
    assert usage_error(flavor, M, "--max-num-seq", "4") == "unrecognized arguments: --max-num-seq 4"


@pytest.mark.parametrize("flavor", FLAVORS)
def test_bad_values(flavor: str) -> None:
    assert usage_error(flavor, M, "--gpu-memory-utilization", "abc") == (
        "argument --gpu-memory-utilization: invalid float value: 'abc'"
    )
    assert usage_error(flavor, M, "--max-num-seqs", "1.5") == (
        "argument --max-num-seqs: invalid int value: '1.5'"
    )
    assert usage_error(flavor, M, "--tensor-parallel-size", "two") == (
        "argument --tensor-parallel-size/-tp: invalid int value: 'two'"
    )
    assert usage_error(flavor, M, "--max-num-seqs") == (
        "argument --max-num-seqs: expected one argument"
    )
    assert usage_error(flavor, M, "--max-num-seqs", "--enforce-eager") == (
        "argument --max-num-seqs: expected one argument"
    )
    assert usage_error(flavor, M, "--served-model-name") == (
        "argument --served-model-name: expected at least one argument"
    )
    assert usage_error(flavor, M, "--dtype", "fp16").startswith(
        "argument --dtype: invalid choice: 'fp16' (choose from 'auto', "
    )


def test_optional_ints_word_their_errors_as_the_release_does() -> None:
    assert usage_error("v0", M, "--num-gpu-blocks-override", "x") == (
        "argument --num-gpu-blocks-override: invalid int value: 'x'"
    )
    for flavor in V1:
        assert usage_error(flavor, M, "--num-gpu-blocks-override", "x") == (
            "argument --num-gpu-blocks-override: Value x cannot be converted to <class 'int'>."
        )
        assert parse(flavor, M, "--num-gpu-blocks-override", "None").num_gpu_blocks_override is None
    assert parse("v1-0.10", M, "--seed", "None").seed is None


def test_no_model() -> None:
    for flavor in FLAVORS:
        assert usage_error(flavor) == "the following arguments are required: model_tag"
        assert usage_error(flavor, "--port", "8001") == (
            "the following arguments are required: model_tag"
        )
        # served-model-name takes every word that follows it, the model too
        assert usage_error(flavor, "--served-model-name", "chat", M) == (
            "the following arguments are required: model_tag"
        )
        assert usage_error(flavor, "--model=") == "the following arguments are required: model_tag"
    # A missing model is reported before unrecognized arguments, as argparse does.
    assert usage_error("v0", "--foo") == "the following arguments are required: model_tag"


@pytest.mark.parametrize("flavor", FLAVORS)
def test_config_files_are_refused(flavor: str) -> None:
    for argv in ([M, "--config", "serve.yaml"], [M, "--config=serve.yaml"]):
        message = usage_error(flavor, *argv)
        assert message.startswith("--config is not supported by the simulator")


def test_gpu_memory_utilization_range() -> None:
    for flavor in ("v0", "v1-0.8", "v1-0.10"):
        assert config_error(flavor, M, "--gpu-memory-utilization", "1.5") == (
            "GPU memory utilization must be less than 1.0. Got 1.5."
        )
        assert parse(flavor, M, "--gpu-memory-utilization", "1").gpu_memory_utilization == 1.0
        for low in ("0", "-0.5", "nan"):
            message = config_error(flavor, M, "--gpu-memory-utilization", low)
            assert message.startswith("No available memory for the cache blocks.")
    high = refused("v1-latest", M, "--gpu-memory-utilization", "1.5")
    assert high.exc_type == "pydantic_core._pydantic_core.ValidationError"
    assert high.message == (
        "1 validation error for CacheConfig\ngpu_memory_utilization\n"
        "  Input should be less than or equal to 1 "
        "[type=less_than_equal, input_value=1.5, input_type=float]"
    )
    assert "Input should be greater than 0" in config_error(
        "v1-latest", M, "--gpu-memory-utilization", "0"
    )


def test_block_size_choices_per_release() -> None:
    assert usage_error("v0", M, "--block-size", "1") == (
        "argument --block-size: invalid choice: 1 (choose from 8, 16, 32, 64, 128)"
    )
    assert usage_error("v0", M, "--block-size", "256").startswith(
        "argument --block-size: invalid choice: 256"
    )
    for flavor in ("v1-0.8", "v1-0.10"):
        assert parse(flavor, M, "--block-size", "1").block_size == 1
        assert usage_error(flavor, M, "--block-size", "48") == (
            "argument --block-size: invalid choice: 48 (choose from 1, 8, 16, 32, 64, 128)"
        )
    # 2026: any positive int (hybrid models use odd sizes); CacheConfig checks > 0.
    assert parse("v1-latest", M, "--block-size", "48").block_size == 48
    assert "block_size\n  Input should be greater than 0" in config_error(
        "v1-latest", M, "--block-size", "0"
    )
    assert usage_error("v1-latest", M, "--block-size", "x") == (
        "argument --block-size: invalid int value: 'x'"
    )


def test_scheduler_limits() -> None:
    for flavor in FLAVORS:
        message = config_error(flavor, M, "--max-num-seqs", "64", "--max-num-batched-tokens", "32")
        assert message == (
            "max_num_batched_tokens (32) must be greater than or equal to max_num_seqs (64)."
        )
        assert "max_num_seqs" in config_error(flavor, M, "--max-num-seqs", "0")
    # The V1 default budget (8192) is checked against --max-num-seqs too.
    assert config_error("v1-0.10", M, "--max-num-seqs", "10000") == (
        "max_num_batched_tokens (8192) must be greater than or equal to max_num_seqs (10000)."
    )
    assert "greater than or equal to 1" in config_error("v1-latest", M, "--max-num-seqs", "0")
    assert "max_model_len" in config_error("v1-0.10", M, "--max-model-len", "0")
    assert config_error("v1-latest", M, "--max-num-batched-tokens", "0").startswith(
        "1 validation error for SchedulerConfig\nmax_num_batched_tokens"
    )


def test_other_engine_checks() -> None:
    assert config_error("v0", M, "--cpu-offload-gb", "-1") == (
        "CPU offload space must be non-negative, but got -1.0"
    )
    assert "OffloadConfig" in config_error("v1-latest", M, "--cpu-offload-gb", "-1")
    assert "tensor_parallel_size" in config_error("v1-0.8", M, "-tp", "0")
    assert "shutdown_timeout" in config_error("v1-latest", M, "--shutdown-timeout", "-5")
    assert config_error("v0", M, "--port", "70000") == "bind(): port must be 0-65535."
    assert "No available memory" in config_error("v1-0.10", M, "--num-gpu-blocks-override", "0")


def test_kv_cache_dtype_choices_per_release() -> None:
    assert usage_error("v0", M, "--kv-cache-dtype", "fp8_inc") == (
        "argument --kv-cache-dtype: invalid choice: 'fp8_inc' "
        "(choose from 'auto', 'fp8', 'fp8_e5m2', 'fp8_e4m3')"
    )
    assert parse("v1-0.10", M, "--kv-cache-dtype", "fp8_inc").kv_cache_dtype == "fp8_inc"
    assert usage_error("v1-0.10", M, "--kv-cache-dtype", "bfloat16").startswith(
        "argument --kv-cache-dtype: invalid choice: 'bfloat16'"
    )
    assert parse("v1-latest", M, "--kv-cache-dtype", "bfloat16").kv_cache_dtype == "bfloat16"
    for flavor in FLAVORS:
        assert parse(flavor, M, "--kv-cache-dtype", "fp8").kv_cache_dtype == "fp8"
        assert "invalid choice: 'FP8'" in usage_error(flavor, M, "--kv-cache-dtype", "FP8")


def test_preemption_mode_choices_per_release() -> None:
    # Before the 0.9 config dataclass --preemption-mode was a free string (V0 reads anything
    # but "swap" as recompute); 0.9/0.10 list the Literal's values.
    for flavor in ("v0", "v1-0.8"):
        assert parse(flavor, M, "--preemption-mode", "swap").preemption_mode == "swap"
        assert parse(flavor, M, "--preemption-mode", "whatever").preemption_mode == "whatever"
    assert parse("v1-0.10", M, "--preemption-mode", "recompute").preemption_mode == "recompute"
    assert usage_error("v1-0.10", M, "--preemption-mode", "never") == (
        "argument --preemption-mode: invalid choice: 'never' (choose from 'recompute', 'swap', "
        "'None')"
    )


# ------------------------------------------------------------------------------------------
# Version gating


def test_shutdown_timeout_only_in_latest() -> None:
    assert parse("v1-latest", M, "--shutdown-timeout", "30").shutdown_timeout == 30
    assert parse("v1-latest", M, "--shutdown_timeout=30").shutdown_timeout == 30
    for flavor in ("v0", "v1-0.8", "v1-0.10"):
        assert usage_error(flavor, M, "--shutdown-timeout", "30") == (
            "unrecognized arguments: --shutdown-timeout 30"
        )


def test_swap_space_and_preemption_mode_gone_in_latest() -> None:
    for flavor in ("v0", "v1-0.8", "v1-0.10"):
        args = parse(flavor, M, "--swap-space", "8", "--preemption-mode", "recompute")
        assert args.swap_space == 8.0 and args.preemption_mode == "recompute"
    assert usage_error("v1-latest", M, "--swap-space", "8") == (
        "unrecognized arguments: --swap-space 8"
    )
    assert usage_error("v1-latest", M, "--preemption-mode=recompute") == (
        "unrecognized arguments: --preemption-mode=recompute"
    )


def test_flags_that_arrived_or_left() -> None:
    gated = {
        # flag and value: the flavours that accept it
        ("--data-parallel-size", "2"): V1,
        ("-dp", "2"): V1,
        ("--api-server-count", "2"): ("v1-0.10", "v1-latest"),
        ("--prefix-caching-hash-algo", "sha256"): V1,
        ("--kv-cache-memory-bytes", "8G"): ("v1-latest",),
        ("--calculate-kv-scales",): ("v1-0.8", "v1-0.10"),  # gone by 0.32
        ("--enable-log-requests",): ("v1-0.10", "v1-latest"),
        ("--disable-log-requests",): ("v0", "v1-0.8", "v1-0.10"),  # removed in 0.12
    }
    for argv, accepted in gated.items():
        for flavor in FLAVORS:
            if flavor in accepted:
                parse(flavor, M, *argv)
            else:
                assert usage_error(flavor, M, *argv) == "unrecognized arguments: " + " ".join(argv)
    assert parse("v1-0.10", M, "-asc", "4").api_server_count == 4
    assert parse("v1-0.10", M, "--no-disable-log-requests").disable_log_requests is False
    assert usage_error("v1-0.8", M, "--prefix-caching-hash-algo", "sha256_cbor").startswith(
        "argument --prefix-caching-hash-algo: invalid choice: 'sha256_cbor'"
    )
    assert usage_error("v1-latest", M, "--prefix-caching-hash-algo", "builtin").startswith(
        "argument --prefix-caching-hash-algo: invalid choice: 'builtin'"
    )


def test_known_options_per_flavour() -> None:
    assert "--shutdown-timeout" in known_options("v1-latest")
    assert "--swap-space" not in known_options("v1-latest")
    assert "--no-enable-prefix-caching" in known_options("v0")
    assert "--no-enforce-eager" not in known_options("v0")
    assert "--data-parallel-size" not in known_options("v0")
    assert {"-tp", "-pp", "-dp", "-asc"} <= known_options("v1-0.10")


# ------------------------------------------------------------------------------------------
# Error rendering


def test_errors_render_as_vllm_prints_them() -> None:
    assert main_error("unrecognized arguments: --foo") == (
        "vllm serve: error: unrecognized arguments: --foo"
    )
    err = refused("v0", M, "--foo")
    assert err.render() == "vllm serve: error: unrecognized arguments: --foo"
    assert err.render("api_server.py") == "api_server.py: error: unrecognized arguments: --foo"
    assert str(err) == "unrecognized arguments: --foo"
    crash = refused("v0", M, "--gpu-memory-utilization", "2")
    assert crash.render() == "ValueError: GPU memory utilization must be less than 1.0. Got 2.0."


# ------------------------------------------------------------------------------------------
# Model-derived settings


def test_resolve_for_model() -> None:
    v0 = resolve_for_model(parse("v0", M), "v0", 8192)
    assert (v0.max_model_len, v0.max_num_batched_tokens, v0.enable_chunked_prefill) == (
        8192,
        8192,
        False,
    )
    long = resolve_for_model(parse("v0", M), "v0", 131072)  # chunked prefill above 32K
    assert (long.max_num_batched_tokens, long.enable_chunked_prefill) == (512, True)
    short = resolve_for_model(parse("v0", M, "--max-model-len", "1024"), "v0", 8192)
    assert short.max_num_batched_tokens == 2048
    v1 = resolve_for_model(parse("v1-latest", M, "--max-model-len", "auto"), "v1-latest", 40960)
    assert (v1.max_model_len, v1.max_num_batched_tokens) == (40960, 8192)
    err = refused_resolve(parse("v1-0.10", M, "--max-model-len", "64k"), "v1-0.10", 40960)
    assert err.startswith("User-specified max_model_len (64000) is greater than the derived")
    err = refused_resolve(parse("v0", M, "--max-num-batched-tokens", "4096"), "v0", 8192)
    assert err.startswith("max_num_batched_tokens (4096) is smaller than max_model_len (8192).")
    # With chunked prefill the budget may be smaller than the context.
    ok = parse("v0", M, "--max-num-batched-tokens", "4096", "--enable-chunked-prefill")
    assert resolve_for_model(ok, "v0", 8192).max_num_batched_tokens == 4096
    err = refused_resolve(parse("v0", M, "--max-num-seqs", "4096"), "v0", 2048)
    assert (
        err == "max_num_batched_tokens (2048) must be greater than or equal to max_num_seqs (4096)."
    )


def refused_resolve(args: ServeArgs, flavor: str, derived: int) -> str:
    with pytest.raises(ServeArgsError) as info:
        resolve_for_model(args, flavor, derived)
    assert info.value.exit_code == 1
    return info.value.message


# ------------------------------------------------------------------------------------------
# vllm:cache_config_info

PAGES = {"v0": "v0-0.6.prom", "v1-0.10": "v1-0.10.prom", "v1-latest": "v1-2026.prom"}
V0_07_PAGE = "v0-0.7-aibrix-doc-qwen2.5-coder-1.5b.prom"
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def page_labels(name: str) -> dict[str, str]:
    """The first vllm:cache_config_info series on a fixture page, without ``engine``."""
    line = next(
        line for line in read_page(name).splitlines() if line.startswith("vllm:cache_config_info{")
    )
    labels = dict(_LABEL.findall(line[line.index("{") : line.rindex("}")]))
    labels.pop("engine", None)
    return labels


@pytest.mark.parametrize("flavor", list(PAGES))
def test_label_names_match_the_fixture_page(flavor: str) -> None:
    labels = cache_config_labels(parse(flavor, M), flavor, 1000, max_model_len=8192)
    assert set(labels) == set(page_labels(PAGES[flavor]))


def test_label_names_of_0_8() -> None:
    """0.8.5's CacheConfig: the 0.7 set plus prefix_caching_hash_algo and swap_space."""
    labels = cache_config_labels(parse("v1-0.8", M), "v1-0.8", 1000)
    expected = set(page_labels(V0_07_PAGE)) | {"prefix_caching_hash_algo", "swap_space"}
    assert set(labels) == expected


def test_defaults_reproduce_the_fixture_pages_values() -> None:
    """The pages were made with these flags; every label value follows from them."""
    v0 = parse("v0", M, "--enable-prefix-caching")
    assert cache_config_labels(v0, "v0", 26843, num_cpu_blocks=2048) == page_labels(PAGES["v0"])
    v010 = cache_config_labels(parse("v1-0.10", "Qwen/Qwen3-8B", "-dp", "2"), "v1-0.10", 25031)
    assert v010 == page_labels(PAGES["v1-0.10"])
    latest = parse("v1-latest", "Qwen/Qwen3-32B", "--data-parallel-size", "4")
    labels = cache_config_labels(latest, "v1-latest", 20480, max_model_len=40960)
    assert labels == page_labels(PAGES["v1-latest"])
    assert labels["kv_cache_size_tokens"] == "327680"
    assert labels["kv_cache_max_concurrency"] == "8.0"
    aibrix = cache_config_labels(parse("v0", M), "v0", 81767, num_cpu_blocks=9362)
    assert aibrix == {
        k: v for k, v in page_labels(V0_07_PAGE).items() if k != "calculate_kv_scales"
    }


@pytest.mark.parametrize("flavor", FLAVORS)
def test_label_values_follow_the_flags(flavor: str) -> None:
    argv = [M, "--gpu-memory-utilization", "0.8", "--block-size", "32", "--kv-cache-dtype", "fp8"]
    args = parse(flavor, *argv, "--enable-prefix-caching", "--num-gpu-blocks-override", "512")
    labels = cache_config_labels(args, flavor, 512, num_cpu_blocks=64, max_model_len=4096)
    assert labels["gpu_memory_utilization"] == "0.8"
    assert labels["block_size"] == "32"
    assert labels["enable_prefix_caching"] == "True"
    assert labels["cache_dtype"] == "fp8"
    assert labels["num_gpu_blocks"] == "512"
    assert labels["num_gpu_blocks_override"] == "512"
    assert labels["num_cpu_blocks"] == "64"
    no_cache = parse(flavor, M, "--no-enable-prefix-caching")
    assert cache_config_labels(no_cache, flavor, 1)["enable_prefix_caching"] == "False"


def test_swap_space_label_keeps_vllms_number_type() -> None:
    """V0/0.8 keep the int default (4) but argparse's float for a given value; 0.10 coerces."""
    for flavor in ("v0", "v1-0.8"):
        assert cache_config_labels(parse(flavor, M), flavor, 1)["swap_space_bytes"] == "4294967296"
        given_ = cache_config_labels(parse(flavor, M, "--swap-space", "8"), flavor, 1)
        assert given_["swap_space_bytes"] == str(8.0 * GIB_BYTES) == "8589934592.0"
        offload = cache_config_labels(parse(flavor, M, "--cpu-offload-gb", "2"), flavor, 1)
        assert offload["cpu_offload_gb"] == "2.0"
    labels = cache_config_labels(parse("v1-0.10", M, "--swap-space", "8"), "v1-0.10", 1)
    assert (labels["swap_space"], labels["swap_space_bytes"]) == ("8.0", "8589934592.0")
    assert cache_config_labels(parse("v1-0.8", M), "v1-0.8", 1)["swap_space"] == "4"


def test_latest_labels_derived_from_blocks() -> None:
    args = parse("v1-latest", M, "--block-size", "32", "--kv-cache-memory-bytes", "16G")
    labels = cache_config_labels(args, "v1-latest", 1000, max_model_len=16000)
    assert labels["kv_cache_size_tokens"] == "32000"
    assert labels["kv_cache_max_concurrency"] == "2.0"
    assert labels["user_specified_block_size"] == "True"
    assert labels["kv_cache_memory_bytes"] == str(16 * 2**30)
    assert labels["prefix_caching_hash_algo"] == "sha256"
    # max_model_len from the flags, or unknown
    from_flag = parse("v1-latest", M, "--max-model-len", "8000")
    assert cache_config_labels(from_flag, "v1-latest", 1000)["kv_cache_max_concurrency"] == "2.0"
    assert cache_config_labels(parse("v1-latest", M), "v1-latest", 1)[
        "kv_cache_max_concurrency"
    ] == ("None")
    assert (
        cache_config_labels(replace(args, gpu_memory_utilization=1), "v1-latest", 1)[
            "gpu_memory_utilization"
        ]
        == "1.0"
    )


# ------------------------------------------------------------------------------------------
# Property: spelling and order never change the result

_COMMON_VALUES: dict[str, list[str]] = {
    "--gpu-memory-utilization": ["0.5", "0.85", "1"],
    "--max-num-seqs": ["16", "64", "128"],
    "--max-num-batched-tokens": ["4096", "16384"],
    "--max-model-len": ["4096", "32768"],
    "--kv-cache-dtype": ["auto", "fp8", "fp8_e5m2"],
    "--tensor-parallel-size": ["1", "2"],
    "--pipeline-parallel-size": ["1", "2"],
    "--cpu-offload-gb": ["0", "2.5"],
    "--num-gpu-blocks-override": ["1024"],
    "--seed": ["0", "7"],
    "--port": ["8000", "8123"],
    "--host": ["127.0.0.1"],
    "--api-key": ["sk_test"],
    "--served-model-name": ["chat_model"],
    "--dtype": ["auto", "bfloat16", "half"],
}
_BY_FLAVOR: dict[str, dict[str, list[str]]] = {
    "v0": {"--swap-space": ["0", "8"], "--block-size": ["8", "16", "32"]},
    "v1-0.8": {"--swap-space": ["8"], "--block-size": ["16", "32"], "--data-parallel-size": ["2"]},
    "v1-0.10": {"--block-size": ["16", "64"], "--api-server-count": ["2"],
                "--preemption-mode": ["recompute"]},
    "v1-latest": {"--block-size": ["16", "48"], "--shutdown-timeout": ["0", "30"],
                  "--kv-cache-memory-bytes": ["1000000"]},
}  # fmt: skip
_BOOLEANS: dict[str, list[str]] = {
    "v0": ["--enforce-eager", "--trust-remote-code", "--disable-log-stats",
           "--enable-prefix-caching", "--no-enable-prefix-caching", "--disable-log-requests"],
    "v1-0.8": ["--enforce-eager", "--calculate-kv-scales", "--no-enable-prefix-caching",
               "--disable-log-requests"],
    "v1-0.10": ["--no-enforce-eager", "--trust-remote-code", "--enable-log-requests",
                "--no-calculate-kv-scales"],
    "v1-latest": ["--enforce-eager", "--no-trust-remote-code", "--enable-chunked-prefill",
                  "--no-enable-chunked-prefill", "--disable-log-stats"],
}  # fmt: skip


def _spell(name: str, draw: st.DrawFn) -> str:
    """A random mix of dashes and underscores in the name (never the leading '--')."""
    body = "".join(c if c != "-" or not draw(st.booleans()) else "_" for c in name[2:])
    return "--" + body


@st.composite
def command_lines(draw: st.DrawFn) -> tuple[str, list[str], list[str]]:
    """A flavour, a canonical command line, and the same flags shuffled and respelled."""
    flavor = draw(st.sampled_from(FLAVORS))
    values = {**_COMMON_VALUES, **_BY_FLAVOR[flavor]}
    chosen_values = draw(st.lists(st.sampled_from(sorted(values)), unique=True, max_size=9))
    pairs = [(name, draw(st.sampled_from(values[name]))) for name in chosen_values]
    # one of each --x/--no-x pair at most, so the order cannot matter
    booleans = draw(st.lists(st.sampled_from(_BOOLEANS[flavor]), unique=True, max_size=4))
    kept: dict[str, str] = {}
    for flag in booleans:
        kept.setdefault(flag.replace("--no-", "--"), flag)
    booleans = list(kept.values())

    canonical = (
        [M] + [tok for name, value in sorted(pairs) for tok in (name, value)] + sorted(booleans)
    )
    items: list[list[str]] = []
    for name, value in pairs:
        spelled = _spell(name, draw)
        items.append([f"{spelled}={value}"] if draw(st.booleans()) else [spelled, value])
    items += [[_spell(b, draw)] for b in booleans]
    items = draw(st.permutations(items))
    shuffled = [tok for item in items for tok in item]
    if draw(st.booleans()):
        shuffled = [M, *shuffled]
    else:  # --model anywhere, api_server style (the "auto" entrypoint takes both)
        at = draw(st.integers(0, len(items)))
        model = [f"--model={M}"] if draw(st.booleans()) else ["--model", M]
        shuffled = (
            [tok for item in items[:at] for tok in item]
            + model
            + [tok for item in items[at:] for tok in item]
        )
    return flavor, canonical, shuffled


@settings(max_examples=300, deadline=None)
@given(command_lines())
def test_order_spelling_and_form_never_change_the_result(
    case: tuple[str, list[str], list[str]],
) -> None:
    flavor, canonical, shuffled = case
    assert parse_serve_args(shuffled, flavor) == parse_serve_args(canonical, flavor)
