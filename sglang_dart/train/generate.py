"""Regenerate training conversations with the target itself, through a real SGLang server.

    python -m sglang_dart.train.generate --target DIR --out data.jsonl [--num-prompts N] [--magpie M]
        [--max-new-tokens 256] [--concurrency 16] [--dtype auto] [--exclude-file PROMPTS.txt]
        [--temperature 0.0] [--samples-per-prompt 1] [--follow-ups GENERATED.jsonl[.gz] ...]
        [--draft DIR --store FILE | --server-url URL]

Each output line is {"prompt": str, "input_ids": [...], "prompt_len": int, "text": str}: the chat-templated
prompt followed by the target's answer (greedy by default). A drafter trained on the target's own outputs
learns what the verifier will accept; `text` feeds `python -m sglang_dart.ngram build` for the 3-gram store.
Sampled answers (`--temperature > 0`, several per prompt) add variety from a fixed prompt list: the trainer
labels every position with the target's argmax anyway, so sampling changes the contexts, not the targets.
`--magpie M` adds M user prompts the target writes itself (`magpie.py`), mixed with the pool's;
`--follow-ups FILES` adds one more user turn, written by the target too, to each finished answer of
earlier output, and answers the longer conversations (multi-turn variety). Rows of a conversation also
record its turns (`messages`).

The prompt list is saved first (`OUT.prompts.json`) and rows are appended to `OUT.partial` as they come;
a run started again with the same OUT after an interruption reuses that list and answers only what is
missing, so a long generation can span sessions. Magpie prompts are saved as they are sampled
(`OUT.magpie.jsonl`, folded into the list once it is written): a run stopped while sampling keeps them
(follow-ups likewise, in `OUT.follow-ups.jsonl`).
`--draft` and `--store` serve the target with DART (an earlier drafter, e.g. the shipped one): the answers
are the target's own (speculation is lossless), only sooner. `--server-url` answers with a server of the
target that is already running (on a GPU machine, say) instead of starting one.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

from sglang_dart.jsonl import iter_jsonl
from sglang_dart.train import magpie
from sglang_dart.train.conversations import read_prompts, templated_ids
from sglang_dart.train.prompts import training_prompts

Prompt = str | list[dict[str, str]]


def chat_prompt_ids(tokenizer, prompt: Prompt) -> list[int]:
    """The chat-templated ids of a prompt: one user turn, or a conversation ending with a user turn."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return templated_ids(tokenizer, messages, add_generation_prompt=True)


@contextmanager
def target_server(
    target: Path, concurrency: int, log_dir: Path, dtype: str = "auto", extra_args: list[str] | None = None
) -> Iterator[Any]:
    """A running SGLang server for the target (its log in log_dir), stopped on the way out."""
    from sglang_dart.server_process import SglangServer

    server = SglangServer(
        target,
        ["--max-running-requests", str(concurrency), "--dtype", dtype, *(extra_args or [])],
        log_dir / "generate-server.log",
    )
    try:  # started inside the try: a SIGTERM while it boots must stop it too
        server.start()
        yield server
    finally:
        server.stop()


def running_server(url: str, target: Path) -> Any:
    """A client of the SGLang server at `url`; ValueError if nothing answers there. A server that loaded
    another path than `target` is used with a warning: the same model can sit at different paths."""
    import requests

    from sglang_dart.server_process import SglangClient

    client = SglangClient(url)
    try:
        served = client.model_info()["model_path"]
    except (requests.RequestException, ValueError, KeyError) as exc:
        raise ValueError(f"no SGLang server answers /model_info at {url}: {exc}") from exc
    if Path(served).expanduser().resolve() != target.expanduser().resolve():
        print(f"warning: the server at {url} serves {served}, not {target}", file=sys.stderr)
    return client


@contextmanager
def answering_server(args: argparse.Namespace, speculation: list[str], running: Any | None) -> Iterator[Any]:
    """`running` (the client of --server-url's server), or a server started for the target, its log
    beside OUT (a failed run keeps its cause) and stopped on the way out."""
    if running is not None:
        yield running
        return
    dtype = args.dtype or "auto"
    with target_server(args.target, args.concurrency, args.out.parent, dtype, speculation) as server:
        yield server


def answers(
    server: Any,
    tokenizer: Any,
    prompts: list[Prompt],
    max_new_tokens: int,
    concurrency: int,
    temperature: float = 0.0,
) -> Iterator[dict]:
    """Yield one row per prompt, in prompt order, as soon as it and every row before it are answered."""
    params = {"max_new_tokens": max_new_tokens, "temperature": temperature}

    def one(prompt: Prompt) -> dict:
        ids = chat_prompt_ids(tokenizer, prompt)
        out = server.generate({"input_ids": ids, "sampling_params": params}, timeout=3600)
        return answer_row(tokenizer, prompt, ids, [int(t) for t in out["output_ids"]])

    pool = ThreadPoolExecutor(max_workers=concurrency)
    try:
        yield from pool.map(one, prompts)
    finally:  # an interrupted run stops now: queued prompts are dropped, the server stop ends the rest
        pool.shutdown(wait=False, cancel_futures=True)


def answer_row(tokenizer: Any, prompt: Prompt, prompt_ids: list[int], answer_ids: list[int]) -> dict:
    """One output row: the prompt, the templated prompt's ids followed by the answer's, where the answer
    starts, and the whole as text (a conversation also records its turns)."""
    full = prompt_ids + answer_ids
    row = {
        "prompt": _prompt_key(prompt),
        "input_ids": full,
        "prompt_len": len(prompt_ids),
        "text": tokenizer.decode(full),
    }
    if not isinstance(prompt, str):  # a conversation: its turns, which `prompt` alone does not hold
        row["messages"] = prompt
    return row


def _prompt_key(prompt: Prompt) -> str:
    """What a row records as its prompt: the prompt, or a conversation's last user turn."""
    return prompt if isinstance(prompt, str) else prompt[-1]["content"]


def unanswered(prompts: list[Prompt], rows: list[dict]) -> list[Prompt]:
    """The prompts still to answer when `rows` are done: each answered row takes one occurrence of its
    prompt off the list (a prompt answered several times is listed that many times)."""
    done = Counter(row["prompt"] for row in rows)
    left = []
    for prompt in prompts:
        key = _prompt_key(prompt)
        if done[key]:
            done[key] -= 1
        else:
            left.append(prompt)
    return left


def _read_rows(path: Path) -> list[dict]:
    """The complete JSON lines of a file written as it went (a line cut off by a kill is dropped)."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m sglang_dart.train.generate", description=__doc__.split("\n")[0]
    )
    p.add_argument("--target", required=True, type=Path, help="target model directory (HF layout)")
    p.add_argument("--out", required=True, type=Path, help="output .jsonl")
    p.add_argument("--num-prompts", type=int, default=None, help="default: every prompt of the pool")
    p.add_argument(
        "--prompts",
        type=Path,
        default=None,
        help="prompts to answer instead of the built-in pool: .txt (one per line) or .jsonl of "
        "{prompt}, OpenAI {messages} or ShareGPT {conversations} (answered after the last user turn)",
    )
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dtype", default=None, help="target dtype, as the server that will use the drafter (default: auto)"
    )
    p.add_argument("--exclude-file", type=Path, default=None, help="prompts (one per line) to keep out")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy answers")
    p.add_argument("--samples-per-prompt", type=int, default=1, help="answers per prompt (with sampling)")
    p.add_argument(
        "--magpie", type=int, default=0, help="add this many user prompts written by the target itself"
    )
    p.add_argument(
        "--magpie-system",
        default=None,
        help="system prompt that frames the sampled user turns, e.g. a coding assistant's to get code "
        "questions (the answers use the template's default)",
    )
    p.add_argument(
        "--follow-ups",
        type=Path,
        nargs="+",
        default=None,
        help="files this command wrote (.jsonl or .jsonl.gz): the target writes one more user turn for "
        "each of their finished answers, and answers it (multi-turn conversations)",
    )
    p.add_argument(
        "--num-follow-ups",
        type=int,
        default=None,
        help="follow up this many of the finished answers (a --seed sample; default: every one)",
    )
    p.add_argument("--draft", type=Path, default=None, help="serve with DART: this drafter directory")
    p.add_argument("--store", type=Path, default=None, help="serve with DART: this 3-gram store")
    p.add_argument(
        "--server-url",
        default=None,
        help="answer with this running SGLang server of the target (http://HOST:PORT) instead of starting "
        "one; its own flags then stand for --dtype, --draft and --store",
    )
    args = p.parse_args(argv)
    speculation = _speculation_flags(p, args)
    if args.server_url is not None and (speculation or args.dtype is not None):
        p.error("--server-url uses a running server: --dtype, --draft and --store are that server's flags")
    if args.temperature < 0 or args.samples_per_prompt < 1:
        p.error("--temperature must be >= 0 and --samples-per-prompt >= 1")
    if args.magpie < 0:
        p.error("--magpie must be >= 0")
    if args.num_follow_ups is not None and (args.num_follow_ups < 1 or args.follow_ups is None):
        p.error("--num-follow-ups needs --follow-ups and must be >= 1")
    if args.samples_per_prompt > 1 and args.temperature == 0:
        p.error("--samples-per-prompt > 1 needs --temperature > 0 (greedy answers would repeat)")
    exclude = set(args.exclude_file.read_text().splitlines()) if args.exclude_file else set()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    partial = args.out.with_name(args.out.name + ".partial")
    prompt_file = args.out.with_name(args.out.name + ".prompts.json")
    magpie_file = args.out.with_name(args.out.name + ".magpie.jsonl")  # sampled prompts, as they come
    follow_up_file = args.out.with_name(args.out.name + ".follow-ups.jsonl")  # the same, for follow-ups
    resume = partial.exists() and prompt_file.exists()
    if resume:
        prompts = json.loads(prompt_file.read_text())
        done = _read_rows(partial)
        partial.write_text("".join(json.dumps(row) + "\n" for row in done))  # without a cut-off line
        print(f"resuming: {len(done)} of {len(prompts)} conversations already in {partial}", file=sys.stderr)
    else:
        prompts, done = _fixed_prompts(p, args, exclude), []
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    if not getattr(tokenizer, "chat_template", None):  # every prompt goes through it: refuse before serving
        p.error(f"{args.target}: the tokenizer has no chat template to put prompts in")
    if args.magpie and not resume:
        try:
            magpie.user_turn_prefix(tokenizer, args.magpie_system)
        except ValueError as exc:
            p.error(f"--magpie: {exc}")
    answered = _answers_to_follow_up(p, args, tokenizer) if args.follow_ups is not None and not resume else []
    count = tokens = 0
    # A server started here runs in its own session; a plain SIGTERM would end this process and leave it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    running = None
    if args.server_url is not None:
        try:
            running = running_server(args.server_url, args.target)
        except ValueError as exc:
            p.error(f"--server-url: {exc}")
    with answering_server(args, speculation, running) as server:
        if not resume:
            if args.magpie:
                prompts = prompts + _magpie_prompts(server, tokenizer, args, exclude, prompts, magpie_file)
            if answered:
                prompts += _follow_up_prompts(server, tokenizer, args, exclude, answered, follow_up_file)
            prompts = prompts * args.samples_per_prompt
            prompt_file.write_text(json.dumps(prompts))
            magpie_file.unlink(missing_ok=True)  # the prompt list holds them now
            follow_up_file.unlink(missing_ok=True)
            partial.write_text("")
        todo = unanswered(prompts, done)
        try:
            with partial.open("a") as f:
                rows = answers(
                    server, tokenizer, todo, args.max_new_tokens, args.concurrency, args.temperature
                )
                with closing(rows):  # on any error the server stops here
                    for row in rows:
                        f.write(json.dumps(row) + "\n")
                        f.flush()
                        count += 1
                        tokens += len(row["input_ids"]) - row["prompt_len"]
        except BaseException:
            log = "" if running else f"; the server's log is {args.out.parent / 'generate-server.log'}"
            print(
                f"stopped after {len(done) + count} of {len(prompts)} conversations; they are in {partial} "
                f"(run the same command again to go on){log}",
                file=sys.stderr,
            )
            raise
    partial.replace(args.out)
    print(f"wrote {len(done) + count} conversations ({tokens} generated tokens this run) to {args.out}")


def _answers_to_follow_up(
    parser: argparse.ArgumentParser, args: argparse.Namespace, tokenizer: Any
) -> list[list[dict[str, str]]]:
    """The finished answers of --follow-ups (a --seed sample of --num-follow-ups of them), as conversations;
    a file that cannot be read or holds none is refused before any server starts."""
    answered: list[list[dict[str, str]]] = []
    skipped_rows: Counter = Counter()
    try:
        stop_ids = stop_token_ids(tokenizer, args.target)
        for path in args.follow_ups:
            found, skipped = answered_conversations(path, tokenizer, stop_ids)
            answered += found
            skipped_rows += skipped
        if answered:
            magpie.follow_up_prefix(tokenizer, answered[0])
    except (OSError, EOFError, ValueError) as exc:  # EOFError: a gzip file cut short
        parser.error(f"--follow-ups: {exc}")
    if not answered:
        parser.error("--follow-ups: the files hold no finished answer")
    if skipped_rows:
        print(f"--follow-ups: skipped {dict(skipped_rows)}", file=sys.stderr)
    if args.num_follow_ups is not None and args.num_follow_ups < len(answered):
        chosen = sorted(random.Random(args.seed).sample(range(len(answered)), args.num_follow_ups))
        answered = [answered[i] for i in chosen]
    return answered


def stop_token_ids(tokenizer: Any, target: Path) -> set[int]:
    """The ids an answer can finish with: the model's end-of-sequence ids (config.json and
    generation_config.json, which the server stops at), the tokenizer's special ids, and the token the
    chat template closes an assistant turn with. SmolLM2's tokenizer, for one, marks only
    `<|im_start|>` and `<|endoftext|>` special, while its answers end with `<|im_end|>`."""
    ids = {int(i) for i in tokenizer.all_special_ids}
    for name in ("config.json", "generation_config.json"):
        path = target / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            ids |= {int(i) for i in (eos if isinstance(eos, list) else [eos]) if i is not None}
    closed = templated_ids(
        tokenizer, [{"role": "user", "content": "a"}, {"role": "assistant", "content": magpie.SENTINEL}]
    )
    text = tokenizer.decode(closed)
    after = text[text.rfind(magpie.SENTINEL) + len(magpie.SENTINEL) :]
    closing = tokenizer(after, add_special_tokens=False)["input_ids"] if after.strip() else []
    if closing:
        ids.add(int(closing[0]))
    return ids


def answered_conversations(
    path: Path, tokenizer: Any, stop_ids: set[int]
) -> tuple[list[list[dict[str, str]]], Counter]:
    """The finished answers of a file `generate` wrote, as conversations ending with the answer (the row's
    `messages`, or its single `prompt` turn, then the answer), and the rows left out by reason (cut off by
    the token budget, empty)."""
    conversations, skipped = [], Counter()
    for _, row in iter_jsonl(path):
        if not isinstance(row, dict) or not {"prompt", "input_ids", "prompt_len"} <= row.keys():
            raise ValueError(f"{path}: a row without prompt/input_ids/prompt_len (not written by generate)")
        messages = row.get("messages", [{"role": "user", "content": row["prompt"]}])
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError(f"{path}: a row whose messages are not a list of turns")
        answer_ids = row["input_ids"][row["prompt_len"] :]
        if not answer_ids or int(answer_ids[-1]) not in stop_ids:
            skipped["answer cut off"] += 1
            continue
        answer = tokenizer.decode(answer_ids, skip_special_tokens=True).strip()
        if answer:
            conversations.append([*messages, {"role": "assistant", "content": answer}])
        else:
            skipped["empty answer"] += 1
    return conversations, skipped


def _follow_up_prompts(
    server: Any,
    tokenizer: Any,
    args: argparse.Namespace,
    exclude: set[str],
    answered: list[list[dict[str, str]]],
    side: Path,
) -> list[list[dict[str, str]]]:
    """A follow-up question for each answered conversation, written by the target; those an interrupted
    run saved to `side` are kept and only the rest are sampled."""
    saved = [row for row in _read_rows(side) if isinstance(row, list)] if side.exists() else []
    side.write_text("".join(json.dumps(c) + "\n" for c in saved))  # without a cut-off line
    done = {json.dumps(c[:-1]) for c in saved}
    todo = [c for c in answered if json.dumps(c) not in done]
    with side.open("a") as f:

        def keep(conversation: list[dict[str, str]]) -> None:
            f.write(json.dumps(conversation) + "\n")
            f.flush()

        written, skipped = magpie.sample_follow_ups(
            server, tokenizer, todo, exclude | {c[-1]["content"] for c in saved},
            concurrency=args.concurrency, on_kept=keep,
        )  # fmt: skip
    print(
        f"follow-ups: {len(saved) + len(written)} second turns written by the target for "
        f"{len(answered)} answers (skipped: {dict(skipped)})",
        file=sys.stderr,
    )
    return saved + written


def _speculation_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The server flags of --draft/--store (both or neither; refused before anything starts)."""
    from sglang_dart.server_process import dart_flags

    if (args.draft is None) != (args.store is None):
        parser.error("--draft and --store go together (the drafter directory and its 3-gram store)")
    if args.draft is None:
        return []
    if not (args.draft / "config.json").is_file():
        parser.error(f"--draft {args.draft}: no config.json there (not a drafter directory)")
    if not args.store.is_file():
        parser.error(f"--store {args.store}: no such file")
    return dart_flags(args.draft, args.store)


def _magpie_prompts(
    server: Any, tokenizer: Any, args: argparse.Namespace, exclude: set[str], others: list[Prompt], side: Path
) -> list[str]:
    """args.magpie prompts written by the target, each saved to `side` as it is kept; prompts an
    interrupted run saved there count, and only the rest are sampled."""
    saved = [row for row in _read_rows(side) if isinstance(row, str)] if side.exists() else []
    side.write_text("".join(json.dumps(p) + "\n" for p in saved))  # without a cut-off line
    wanted = max(0, args.magpie - len(saved))
    with side.open("a") as f:

        def keep(prompt: str) -> None:
            f.write(json.dumps(prompt) + "\n")
            f.flush()

        written, skipped = magpie.sample_prompts(
            server, tokenizer, wanted, exclude | set(map(_prompt_key, others)) | set(saved),
            concurrency=args.concurrency, on_kept=keep, system=args.magpie_system,
        )  # fmt: skip
    print(
        f"magpie: {len(saved) + len(written)} prompts written by the target"
        f"{f' ({len(saved)} from an interrupted run)' if saved else ''} (skipped: {dict(skipped)})",
        file=sys.stderr,
    )
    return saved + written


def _fixed_prompts(
    parser: argparse.ArgumentParser, args: argparse.Namespace, exclude: set[str]
) -> list[Prompt]:
    """The prompts given (--prompts) or the built-in pool's, before Magpie's are added."""
    if args.prompts is None:
        return (
            training_prompts(args.num_prompts, seed=args.seed, exclude=exclude)
            if args.num_prompts != 0
            else []
        )
    try:
        turns, skipped = read_prompts(args.prompts)
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    turns = [t for t in turns if t[-1]["content"] not in exclude]
    if skipped:
        print(f"{args.prompts}: skipped {sum(skipped.values())} rows ({dict(skipped)})", file=sys.stderr)
    if not turns:
        parser.error(f"{args.prompts} holds no prompts")
    return turns[: args.num_prompts]


if __name__ == "__main__":
    main()
