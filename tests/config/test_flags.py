"""`justapi serve`'s flags are made from the config fields: every field is a flag (unless marked
internal), its help is the field's metadata, the default shown is the field's own, the flag
names of the hand-written table before it all remain, and flags reach the config they name."""
from __future__ import annotations

import dataclasses
import re

import click
import pytest

from justapi.config.fields import FlagSpec, flag_spec, option
from justapi.config.flags import config_options, default_text
from justapi.config.serve import SECTION_TYPES, build_config, key_map
from justapi.launch.serve import serve

FLAGS_BEFORE = (  # the hand-written table's flags (and their off switches): all must remain
    "--config --model --workers --threads --cpu-spin --launcher --address --gpu --pd "
    "--pd-separate-pools --pd-shared-pool --pd-lease-s --scheduled --no-scheduled --max-seqs "
    "--max-prefill --max-decode --chunk-size --max-batched-tokens --policy --pool-blocks "
    "--block-size --prefix-cache --no-prefix-cache --max-context --weights --host --port --zmq "
    "--served-model-name --log-level --ready-timeout-s --restart-workers --no-restart-workers "
    "--heartbeat-timeout-s --step-timeout-s --admin --api-key --max-request-bytes --max-queue "
    "--shutdown-grace-s --log-requests --no-log-requests --spec --draft-model --gamma --branch "
    "--spec-tree --spec-budget --spec-adaptive --no-spec-adaptive --zmq-curve-secret-key").split()
HAND_DEFAULT = re.compile(r"\((?:default:? ?)?-?\d[\d.]*\)|\bdefault:? ?-?\d", re.IGNORECASE)


def _params() -> dict[str, click.Parameter]:
    return {param.name: param for param in serve.params if param.name}


def _fields() -> list[dataclasses.Field]:
    return [f for _, f in key_map().values()]


def test_every_field_is_a_flag_named_for_it_unless_internal():
    params = _params()
    for f in _fields():
        if flag_spec(f).internal:
            assert f.name not in params
            continue
        assert f.name in params, f"config field {f.name} has no flag"
        names = params[f.name].opts + params[f.name].secondary_opts
        assert flag_spec(f).decls or f"--{f.name.replace('_', '-')}" in names
    assert set(params) == {f.name for f in _fields()} | {"config_path", "api_key"}


def test_the_flags_of_the_table_before_all_remain():
    names = {name for param in serve.params for name in param.opts + param.secondary_opts}
    assert set(FLAGS_BEFORE) <= names
    assert {"--temperature", "--temp", "--top-k", "--top-p", "--min-p",
            "--repetition-penalty", "--repeat-penalty"} <= names


def test_help_comes_from_the_field_and_shows_its_own_default():
    params = _params()
    for f in _fields():
        spec = flag_spec(f)
        assert spec.help, f"{f.name} has no help text"
        help = params[f.name].help or ""
        assert help.startswith(spec.help)
        shown = re.findall(r"\[default: ([^\]]*)\]", help)
        assert shown == ([default_text(f)] if default_text(f) else [])


def test_help_texts_never_restate_a_default_by_hand():
    """The default is written once, in the field; the help shows it from there."""
    for f in _fields():
        assert not HAND_DEFAULT.search(flag_spec(f).help), (f.name, flag_spec(f).help)


def test_shown_defaults_are_the_fields():
    by_name = {f.name: f for f in _fields()}
    assert default_text(by_name["max_seqs"]) == "32"
    assert default_text(by_name["kv_memory_fraction"]) == "0.25"
    assert default_text(by_name["ready_timeout_s"]) == "120"
    assert default_text(by_name["enable_prefix_cache"]) == "on"
    assert default_text(by_name["restart_workers"]) == "off"
    assert default_text(by_name["device"]) == "device cpu"
    assert default_text(by_name["model"]) == default_text(by_name["temperature"]) == ""
    defaults = build_config({}, {})
    for f in _fields():  # the config built from nothing holds exactly the fields' defaults
        section = next(s for s, cls in SECTION_TYPES.items() if f in dataclasses.fields(cls))
        assert getattr(getattr(defaults, section), f.name) == f.default


def _parse(*argv: str) -> dict:
    with serve.make_context("serve", list(argv)) as context:
        flags = dict(context.params)
    flags.pop("config_path"), flags.pop("api_key")
    return {key: value for key, value in flags.items() if value is not None}


def test_no_flag_given_overrides_nothing():
    assert _parse() == {}


def test_flags_reach_the_fields_they_name():
    given = _parse("--gpu", "--no-prefix-cache", "--pd", "1:1", "--pd-shared-pool",
                   "--no-scheduled", "--max-seqs", "8", "--weights", "q4", "--temp", "0.3",
                   "--top-k", "5", "--repeat-penalty", "1.1", "--kv-memory-fraction", "0.5",
                   "--spec-ngram-max", "6", "--no-spec-adaptive", "--restart-workers")
    assert given == {"device": "cuda", "enable_prefix_cache": False, "pd": "1:1",
                     "pd_separate_pools": False, "scheduled": False, "max_seqs": 8,
                     "weights": "q4", "temperature": 0.3, "top_k": 5,
                     "repetition_penalty": 1.1, "kv_memory_fraction": 0.5, "spec_ngram_max": 6,
                     "spec_adaptive": False, "restart_workers": True}
    given.pop("scheduled")  # PD needs continuous batching
    config = build_config({}, given)
    assert (config.model.device, config.cache.enable_prefix_cache, config.server.workers) == \
        ("cuda", False, 2)
    assert (config.sampling.temperature, config.sampling.top_k, config.sampling.top_p) == \
        (0.3, 5, None)


def test_flag_types_and_choices_come_from_the_fields():
    for argv, message in ((["--max-seqs", "x"], "not a valid integer"),
                          (["--policy", "random"], "fcfs"),
                          (["--spec", "medusa"], "ngram"),
                          (["--temperature", "hot"], "not a valid float")):
        with pytest.raises(click.BadParameter, match=message):
            _parse(*argv)


def test_an_internal_field_is_toml_only():
    @dataclasses.dataclass(frozen=True)
    class Section:
        shown: int = option(1, "A flag.")
        hidden: int = option(2, "TOML only.", internal=True)

    specs = [flag_spec(f) for f in dataclasses.fields(Section)]
    assert specs == [FlagSpec("A flag."), FlagSpec("TOML only.", internal=True)]
    command = click.command()(lambda **flags: None)
    for decorate in config_options([Section]):
        command = decorate(command)
    assert [(p.name, p.opts, p.help) for p in command.params] == \
        [("shown", ["--shown"], "A flag.  [default: 1]")]


def test_no_cuda_graphs_turns_the_graphs_off():
    assert build_config({}, {}).model.cuda_graphs
    given = _parse("--no-cuda-graphs")
    assert given == {"cuda_graphs": False} and not build_config({}, given).model.cuda_graphs
    assert not build_config({"cuda-graphs": False}, {}).model.cuda_graphs


def test_a_bool_with_one_declaration_is_an_on_switch():
    """`--allow-unused-tensors` takes no value (it asked for one: `justapi serve
    --allow-unused-tensors --model x` read `--model` as its value)."""
    assert _parse("--allow-unused-tensors", "--weights", "fp32") == {"allow_unused_tensors": True,
                                                                     "weights": "fp32"}


def test_batch_invariant_is_a_cpu_switch():
    given = _parse("--batch-invariant")
    assert given == {"batch_invariant": True} and build_config({}, given).model.batch_invariant
    assert not build_config({}, {}).model.batch_invariant
    with pytest.raises(ValueError, match="--batch-invariant is for CPU workers"):
        build_config({}, {"batch_invariant": True, "device": "cuda"})
