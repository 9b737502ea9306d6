"""Every flag the training parser accepts either acts (a test exercises it) or is refused at start-up naming the flag.

A flag counts as exercised when its option string appears in a test file (this one excluded) or
when COVERED_ELSEWHERE names the test that covers it. A flag counts as refused when REFUSED gives a
command line with it on which validate_args raises a ValueError that names it. Adding a parser flag
without either makes ``test_every_parser_flag_is_tested_or_refused`` fail.
"""
import argparse
import re
from pathlib import Path

import pytest

from megatron.training.arguments import add_megatron_arguments, parse_args, validate_args

TESTS = Path(__file__).resolve().parent

# Flags exercised by a test whose text does not spell the option (it goes through the dest or a
# config field), or by a test that lives in another file.
# (--attention-backend and --compile-transformer-layers are spelled in tests/test_attention_backend.py and
# tests/test_compile.py.)
COVERED_ELSEWHERE = {
    "--apply-wd-to-qk-layernorm": "tests/test_pretrain_gpt.py::test_weight_decay_exclusions_follow_megatron",
    "--save-retain-interval": "tests/test_checkpointing.py::test_save_retain_interval_prunes_older_checkpoints",
    "--ckpt-step": "tests/test_checkpointing.py::test_ckpt_step_selects_iteration",
}

# Flags accepted for Megatron-LM command lines but refused (with a message naming them) when given a
# value that cannot act in this version.
REFUSED = {
    "--no-position-embedding": ["--no-position-embedding"],
    "--exit-signal-handler-for-training": ["--exit-signal-handler-for-training"],
    "--head-lr-mult": ["--head-lr-mult", "2.0"],
    "--use-persistent-ckpt-worker": ["--use-persistent-ckpt-worker"],
    "--use-tp-pp-dp-mapping": ["--use-tp-pp-dp-mapping"],
    "--full-validation": ["--full-validation"],
    "--log-progress": ["--log-progress"],
    "--log-energy": ["--log-energy"],
    "--pretrained-checkpoint": ["--pretrained-checkpoint", "x"],
    "--vocab-extra-ids": ["--vocab-extra-ids", "4"],
    "--tokenizer-special-tokens": ["--tokenizer-special-tokens", "<a>"],
    "--tiktoken-num-special-tokens": ["--tiktoken-num-special-tokens", "10"],
    "--trust-remote-code": ["--trust-remote-code"],
    "--tokenizer-hf-no-use-fast": ["--tokenizer-hf-no-use-fast"],
    "--tokenizer-hf-no-include-special-tokens": ["--tokenizer-hf-no-include-special-tokens"],
}

VALID = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3"]


def _parser_flags():
    """{long option string: action} for every flag of the training parser (help excluded)."""
    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    flags = {}
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        for option in action.option_strings:
            if option.startswith("--"):
                flags[option] = action
    return flags


def _tests_text():
    return "\n".join(path.read_text() for path in sorted(TESTS.rglob("*.py")) if path.name != Path(__file__).name)


def _spelled_in_tests(flag, text):
    return re.search(r"(?<![\w-])" + re.escape(flag) + r"(?![\w-])", text) is not None


def _covering_test_exists(reference):
    path, _, name = reference.partition("::")
    file = TESTS.parent / path
    return file.is_file() and (not name or re.search(rf"^def {re.escape(name)}\(", file.read_text(), re.M))


def test_every_parser_flag_is_tested_or_refused():
    flags = _parser_flags()
    assert len(flags) > 150, "the parser walk found too few flags: is add_megatron_arguments complete?"
    text = _tests_text()
    orphans = []
    for flag, action in flags.items():
        # An action with several spellings (an alias) is covered by any of them.
        spellings = [option for option in action.option_strings if option.startswith("--")]
        if any(_spelled_in_tests(option, text) for option in spellings):
            continue
        if any(option in COVERED_ELSEWHERE and _covering_test_exists(COVERED_ELSEWHERE[option])
               for option in spellings):
            continue
        if any(option in REFUSED for option in spellings):
            continue
        orphans.append(flag)
    assert orphans == [], (
        f"these parser flags are neither exercised by a test nor refused by validate_args: {orphans}. Write a "
        "test that shows each one acting, or refuse it in arguments.py (and list it in REFUSED here)")


def test_the_tables_name_real_flags_and_real_tests():
    flags = _parser_flags()
    stale = [flag for flag in [*COVERED_ELSEWHERE, *REFUSED] if flag not in flags]
    assert stale == [], f"not parser flags (renamed or removed?): {stale}"
    missing = {flag: ref for flag, ref in COVERED_ELSEWHERE.items() if not _covering_test_exists(ref)}
    assert missing == {}, f"the covering tests do not exist: {missing}"


@pytest.mark.parametrize("flag", sorted(REFUSED))
def test_refused_flag_stops_validation_naming_it(flag, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
        monkeypatch.delenv(name, raising=False)
    validate_args(parse_args(args=VALID))  # the command line is valid without the flag
    with pytest.raises(ValueError) as info:
        validate_args(parse_args(args=[*VALID, *REFUSED[flag]]))
    assert flag in str(info.value)


def test_a_new_untested_flag_would_be_caught(monkeypatch):
    """The walk itself: an added flag with no test and no refusal is reported."""
    import megatron.training.argument_groups as argument_groups

    original = argument_groups._add_logging_args

    def with_new_flag(parser):
        parser = original(parser)
        parser.add_argument("--brand-new-untested-flag", action="store_true")
        return parser

    monkeypatch.setattr(argument_groups, "_add_logging_args", with_new_flag)
    with pytest.raises(AssertionError, match="--brand-new-untested-flag"):
        test_every_parser_flag_is_tested_or_refused()
