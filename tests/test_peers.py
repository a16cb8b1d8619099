"""The llama.cpp peer gets exactly our prompt (stand-in binaries that log like llama.cpp's)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from specdec.errors import SpecdecError
from specdec.peers import LlamaCppPeer

FAKE = textwrap.dedent("""\
    #!{python}
    import sys
    args = sys.argv[1:]
    prompt = open(args[args.index("-f") + 1], encoding="utf-8").read()
    if prompt.endswith("\\n"):          # what llama.cpp's -f does
        prompt = prompt[:-1]
    open({seen!r}, "w", encoding="utf-8").write(prompt)
    if "fail" in prompt:
        sys.exit(1)
    if "--no-display-prompt" in args:   # llama-completion: the answer alone, then its end mark
        print("generated text [end of text]")
    else:
        print(prompt + "generated text")
    print("decoded   12 tokens in    0.500 seconds, speed: 24.0 t/s", file=sys.stderr)
    print("n_drafted = 8", file=sys.stderr)
    print("n_accept  = 6", file=sys.stderr)
    print("eval time =     400.00 ms /    10 runs", file=sys.stderr)
""")


@pytest.fixture
def peer(tmp_path):
    seen = tmp_path / "seen.txt"
    for name in ("llama-speculative-simple", "llama-completion"):
        binary = tmp_path / name
        binary.write_text(FAKE.format(python=sys.executable, seen=str(seen)))
        binary.chmod(0o755)
    return LlamaCppPeer(tmp_path, Path("target.gguf"), Path("draft.gguf"), 2, 4096), seen


@pytest.mark.parametrize("prompt", ["<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "raw text"])
def test_llama_cpp_reads_exactly_our_prompt(peer, prompt):
    runner, seen = peer
    run = runner.run(prompt, 16, "ngram-simple", 8)
    assert seen.read_text(encoding="utf-8") == prompt
    assert (run.tokens, run.seconds, run.drafted, run.accepted) == (12, 0.5, 8, 6)
    assert run.text == "generated text\n"
    plain = runner.run(prompt, 16, "none", 0)
    assert seen.read_text(encoding="utf-8") == prompt and (plain.tokens, plain.seconds) == (10, 0.4)
    assert plain.text == "generated text"  # no prompt echo, no end mark: comparable with ours


def test_a_failed_peer_is_one_clear_error(peer):
    runner, _ = peer
    with pytest.raises(SpecdecError, match="llama.cpp .ngram-simple. failed"):
        runner.run("please fail", 16, "ngram-simple", 8)


def test_missing_binaries(tmp_path):
    with pytest.raises(SpecdecError, match="make llama-tools"):
        LlamaCppPeer(tmp_path, Path("t.gguf"), None, 2, 4096)
