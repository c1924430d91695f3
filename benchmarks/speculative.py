"""Speculative decoding, off against on in one run: output tok/s, speedup, acceptance and greedy equality.

Workloads (each request's prompt is its own: no prompt repeats within a run, the warm-up prompts are not the
timed ones, and none is shared between (workload, streams) cases, since a proposer such as suffix decoding
learns from earlier requests and repeated prompts would flatter it):
- editing: a ~400-token prose passage (sentences drawn from a fixed handwritten bank, slots such as a name, a
  town or a colour filled in, by a seeded RNG) and the instruction to repeat it word for word with its colour
  changed. The answer copies the prompt.
- summarization: a passage of the same kind and the request to copy the three sentences that mention a given
  person. The answer quotes parts of the prompt.
- random: 64 random token ids from a plain range of the vocabulary (nothing to copy), through `generate`. The
  default model answers them by looping (a sentence or a count over and over), which prompt lookup finds: on
  this model it is not a control.
- story: a request for a short story (a subject, a twist, a town and a name drawn from small lists), sampled
  at temperature 0.8 with a seed per request: new prose with nothing in the prompt to copy, where sampling
  keeps the model out of greedy loops, so most drafts are rejected. The control: speculation must not slow it
  down. A seeded sample is the same with speculation on as off, so the comparison below holds for it too.
The passages share the bank's sentence skeletons (only the slots differ), so a proposer that remembers earlier
requests finds some of each passage there; the answer's copy of its own prompt is what the workloads measure.

For each workload and each `--streams` setting S: an engine without speculation and one with
`--speculative-config` are built side by side and warmed up with two other requests of the workload; then the
`--num-requests` requests (default max(4, 2 S): four one after another for a single stream, two full waves for
more) are timed in waves of S requests (one `generate`/`chat` call each), every wave on both engines, the one
that goes first alternating from wave to wave, so a slow spell of a shared machine (runs here differ by up to
10% from one minute to the next) falls on both alike (both engines are dropped before the next case). Greedy
(the story workload: seeded sampling), `--max-tokens` each (512 by default, so an editing answer, the whole
~400-token passage, is not cut off half way), eos honoured.
Reported per (workload, streams): output tok/s off and on (the timed part's output tokens / its wall seconds,
prefill included), speedup (on / off), the mean acceptance length (tokens per verified row: kept drafts plus
the target's own token) and the drafts proposed and kept in the timed part, and identical_greedy: whether every
output's token ids (greedy, or the story's seeded samples) are the same with speculation on as off (on a
difference, the first differing position).
A table goes to stdout and, with `--out`, one JSON object per (workload, streams) is appended; the exit status
is 1 when an output differed or an engine raised (both recorded, with the prompt and the traceback). Each record
carries the machine's load average too: on a shared machine, neighbours' work moves the rates.
The default run (4 workloads x 1 and 16 streams, 16 engines) takes about 12 minutes on a 2-core CPU.

    ladle bench speculative --out benchmarks/results/speculative_cpu.jsonl
    ladle bench speculative --workloads editing --streams 1 --speculative-config '{"method": "suffix"}'
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shlex
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import add_model_arguments, append_result, cpu_model_name, git_commit, utc_timestamp
from engine_server.config import SpeculativeConfig

WORKLOADS = ("editing", "summarization", "random", "story")
STORY_SUBJECTS = (
    "a dragon",
    "a lighthouse keeper",
    "a lost kite",
    "a clockmaker",
    "a river otter",
    "a night train",
    "a robot gardener",
    "a winter market",
    "a painter",
    "a small island",
    "a storm",
    "a violin",
)
STORY_TEMPERATURE = 0.8
STORY_TWISTS = (
    "who is afraid of the dark",
    "on the longest day of the year",
    "who finds a map",
    "told by a cat",
    "in a city under the sea",
    "who cannot stop laughing",
    "and a missing key",
    "a hundred years ago",
)
DEFAULT_SPECULATIVE_CONFIG = '{"method": "ngram", "num_speculative_tokens": 12, "prompt_lookup_max": 4}'
NUM_WARMUP = 2
PASSAGE_CHARS = 1800  # about 400 tokens of this prose in the Llama/SmolLM BPE vocabularies
RANDOM_PROMPT_TOKENS = 64
RANDOM_TOKEN_IDS = range(1000, 16000)  # plain words and pieces in every supported model's vocabulary

# Sentences that mention the passage's person; the summarization workload asks for these.
NAMED = (
    "{name} opened the bakery on the corner of the square every morning at five, long before the first bus came.",
    "Most people in {town} remember the winter when {name} walked across the frozen lake to fetch the doctor.",
    "{name} kept a notebook of every bird seen from the kitchen window, with the date and the hour beside each.",
    "Nobody was surprised when {name} won the chess tournament, because the practice went on every evening.",
    "The letters that {name} wrote to the newspaper about the broken bridge were answered after {number} weeks.",
    "{name} once repaired the church clock with a bicycle chain, and it kept good time for another decade.",
    "On market days {name} sold {color} scarves from a wooden cart that had belonged to an uncle.",
    "The children of the street learned to swim because {name} took them to the river every Saturday in July.",
    "{name} refused to sell the old orchard, even when a company from the city offered a great deal of money.",
    "In the library there is still a shelf of maps that {name} drew by hand during the long flood of that spring.",
    "{name} taught the village choir to sing in four parts, although half of the singers could not read music.",
    "When the power failed for a week, {name} cooked soup for the whole street on a stove in the yard.",
    "A photograph of {name} standing beside a {color} tractor hangs above the counter of the hardware shop.",
    "{name} counted {number} kinds of moss on the north wall of the school and wrote a small book about them.",
    "The neighbours say that {name} never missed a meeting of the {town} council in thirty years.",
)
PLAIN = (
    "The river that runs through {town} floods almost every spring, so the oldest houses stand on stone pillars.",
    "A narrow road climbs from the harbor to the hill, passing a mill, a chapel and a row of {color} cottages.",
    "In the autumn the whole valley smells of apples, and the cider press in the barn works day and night.",
    "The school has only {number} pupils this year, but the teachers still put on a play before every holiday.",
    "Travelers often stop at the inn by the crossroads, where the landlord serves bread, cheese and strong tea.",
    "On clear nights the lights of the next town can be seen across the bay, small and steady like low stars.",
    "The market opens on Thursdays, and farmers bring eggs, honey, wool and sometimes a young goat for sale.",
    "A storm in the last century blew the roof off the town hall, and the repairs took almost two years.",
    "The footpath along the cliffs is closed in winter, because the wind there can knock a grown man over.",
    "Every house on the main street has a window box, and in summer they are full of {color} geraniums.",
    "The railway reached {town} late, and for a long time the station had no roof over its single platform.",
    "Fishermen leave before dawn and return in the early afternoon, when the gulls follow their boats home.",
    "The museum holds a collection of old tools, including saws, planes and a loom that still works.",
    "Children skate on the pond when the ice is thick enough, and the baker sells hot chestnuts at the gate.",
    "In the middle of the square stands a fountain with a stone {animal}, worn smooth by a century of rain.",
    "The forest to the east is home to deer, foxes and, according to the old stories, a very shy {animal}.",
    "Most of the shops close at noon on Saturday, and the streets are quiet until the evening bells ring.",
    "A small ferry crosses the lake twice a day, carrying the post, a few passengers and crates of vegetables.",
    "The old bridge has {number} arches, and each of them was built by a different family of masons.",
    "At the end of the summer there is a fair with music, races and a contest for the largest pumpkin.",
    "The hospital is in the next valley, so the town keeps an ambulance and a driver at the fire station.",
    "Walls of dry stone divide the fields, and some of them are older than any building in {town}.",
    "The bakery sells a dark rye loaf that is baked only on Fridays and is usually gone by nine o'clock.",
    "In the hills above the town there are caves where people once stored ice through the hot months.",
    "The local newspaper prints four pages a week, and half of one page is always about the weather.",
    "A {color} boat lies upside down on the beach, where it has been waiting for a new owner for years.",
    "The church tower leans a little to the west, but engineers say it will stand for centuries more.",
    "Sheep graze on the common land behind the school, and their bells can be heard in every classroom.",
    "The town library lends tools as well as books, from ladders and drills to a press for drying flowers.",
    "During the war the cellars under the brewery sheltered {number} families for several weeks.",
    "Each spring the farmers burn the dry grass on the slopes, and the smoke hangs over the valley for days.",
    "There is a saying in {town} that the weather changes four times before lunch, and it is often true.",
    "The harbor wall was raised after a great wave in the last century, and the old line is still marked.",
    "A bus runs to the city twice a day, but most people prefer the slower train along the coast.",
    "The best view of the valley is from the ruined tower, reached by a steep path of {number} steps.",
    "Wild strawberries grow along the railway line, and in June the children pick them on the way home.",
    "The blacksmith's forge is now a café, but the anvil still stands in the corner beside the fireplace.",
    "A line of poplars marks the old border between two farms that argued about it for generations.",
    "In the long evenings of midsummer the young people gather on the jetty to swim and play guitars.",
    "The post office also sells stamps for collectors, and its walls are covered with framed envelopes.",
    "Snow closes the mountain pass for most of the winter, and then {town} is reached only by sea.",
    "The village green has an old oak with a bench around it, where the oldest residents meet every afternoon.",
    "A small observatory on the ridge was built by a retired sailor who loved to watch the planets.",
    "Every autumn a {animal} is seen near the quarry, and the newspaper always prints a photograph of it.",
    "The town band practises in the school hall on Tuesdays, and its drummer is eighty-two years old.",
)
NAMES = ("Martha", "Jonas", "Elena", "Tobias", "Greta", "Samuel", "Ingrid", "Felix", "Rosa", "Arthur", "Clara",
         "Oskar", "Helen", "Victor", "Nora", "Edgar", "Lucia", "Walter", "Maya", "Hugo", "Agnes", "Simon", "Ida",
         "Bruno")  # fmt: skip
TOWNS = (
    "Aldmere",
    "Brackwater",
    "Corran",
    "Dunsford",
    "Elmbridge",
    "Fallowby",
    "Greystone",
    "Hollin",
    "Ivybank",
    "Kettleby",
    "Lornhaven",
    "Northwick",
    "Ottery",
    "Quarrington",
    "Redbarrow",
    "Saltcombe",
    "Thornby",
)
COLORS = ("red", "blue", "green", "yellow", "white", "black", "orange", "purple", "grey", "brown")
ANIMALS = ("bear", "wolf", "lynx", "heron", "badger", "otter", "owl", "stag", "hare", "eagle", "boar", "swan")

Prompt = str | list[int]  # a user message (sent with the chat template), or token ids sent as they are
Counters = tuple[int, int, int, list[int]]  # proposed tokens, accepted tokens, verified rows, kept histogram


@dataclass(frozen=True)
class Passage:
    """A prose passage of about `PASSAGE_CHARS` characters; three of its sentences mention `name`."""

    sentences: tuple[str, ...]
    name: str
    color: str

    @property
    def text(self) -> str:
        return " ".join(self.sentences)


def make_passage(rng: random.Random, chars: int = PASSAGE_CHARS) -> Passage:
    """Three sentences about one person, one with a colour in it and as many others as reach `chars`, in an
    order of `rng`'s."""
    name, town, color, animal = rng.choice(NAMES), rng.choice(TOWNS), rng.choice(COLORS), rng.choice(ANIMALS)
    chosen = [*rng.sample(NAMED, 3), rng.choice([s for s in PLAIN if "{color}" in s])]
    length = sum(len(s) + 1 for s in chosen)
    for sentence in rng.sample(PLAIN, len(PLAIN)):
        if length >= chars:
            break
        if sentence not in chosen:
            chosen.append(sentence)
            length += len(sentence) + 1
    rng.shuffle(chosen)
    slots = {"name": name, "town": town, "color": color, "animal": animal}
    return Passage(tuple(s.format(**slots, number=rng.randint(3, 90)) for s in chosen), name, color)


def editing_prompt(rng: random.Random) -> str:
    """A passage to repeat with its colour changed: of the instructions tried, the one the default model
    (SmolLM2-135M-Instruct) most often follows by copying, 10 passages in 12 (naming a person or a town to
    change, or a spelling mistake to fix, it more often writes something of its own)."""
    passage = make_passage(rng)
    new_color = rng.choice([c for c in COLORS if c != passage.color])
    return f"Repeat the following text word for word, changing '{passage.color}' to '{new_color}':\n\n{passage.text}"


def summarization_prompt(rng: random.Random) -> str:
    """A passage and a request to copy the sentences about its person (the default model quotes the passage in
    about half of its answer, some of it the wanted sentences, the rest other sentences or words of its own)."""
    passage = make_passage(rng)
    return f"Copy the three sentences of this text that mention {passage.name}:\n\n{passage.text}"


def random_prompt(rng: random.Random) -> list[int]:
    return [rng.choice(RANDOM_TOKEN_IDS) for _ in range(RANDOM_PROMPT_TOKENS)]


def story_prompt(rng: random.Random) -> str:
    """A request for new prose with nothing in the prompt to copy: what speculation must not slow down."""
    subject, twist, town, name = (rng.choice(words) for words in (STORY_SUBJECTS, STORY_TWISTS, TOWNS, NAMES))
    return f"Write a short story about {subject} {twist}, set in {town}, with a friend called {name}."


def make_prompt(workload: str, key: str) -> Prompt:
    """The prompt of `workload` seeded by `key` (a string, so the same on every machine and Python run)."""
    rng = random.Random(f"{workload}/{key}")
    if workload == "editing":
        return editing_prompt(rng)
    if workload == "summarization":
        return summarization_prompt(rng)
    if workload == "random":
        return random_prompt(rng)
    if workload == "story":
        return story_prompt(rng)
    raise ValueError(f"unknown workload {workload!r}; known: {', '.join(WORKLOADS)}")


def case_prompts(workload: str, streams: int, num_requests: int, seed: int) -> tuple[list[Prompt], list[Prompt]]:
    """The warm-up and the timed prompts of one (workload, streams) case, all distinct from each other and from
    every other case's (their seeds differ by case and index)."""
    prompts = [make_prompt(workload, f"{seed}/{streams}/{i}") for i in range(NUM_WARMUP + num_requests)]
    if len({str(p) for p in prompts}) != len(prompts):
        raise ValueError(f"{workload}: two prompts of seed {seed} are the same; try another --seed")
    return prompts[:NUM_WARMUP], prompts[NUM_WARMUP:]


@dataclass
class EngineRun:
    """One engine's timed part: every request's output token ids, its seconds, and the speculation counters
    (None without speculation); `error` the traceback if the engine raised."""

    outputs: list[list[int]] = field(default_factory=list)
    seconds: float = 0.0
    speculation: dict[str, Any] | None = None
    error: str | None = None

    @property
    def output_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def tok_per_s(self) -> float | None:
        return round(self.output_tokens / self.seconds, 2) if self.seconds > 0 and self.error is None else None


def _counters(llm: Any) -> Counters | None:
    speculator = llm.core.speculator
    if speculator is None:
        return None
    stats = speculator.stats
    return stats.proposed_tokens, stats.accepted_tokens, stats.verified_rows, list(stats.kept_histogram)


def speculation_delta(before: Counters, after: Counters) -> dict[str, Any]:
    """The speculation counters of the part between two snapshots (the engine's are cumulative)."""
    proposed, accepted, rows = after[0] - before[0], after[1] - before[1], after[2] - before[2]
    return {
        "proposed_tokens": proposed, "accepted_tokens": accepted, "verified_rows": rows,
        "mean_acceptance_length": round(1.0 + accepted / rows, 3) if rows else None,
        "draft_acceptance_rate": round(accepted / proposed, 3) if proposed else None,
        "kept_histogram": [a - b for a, b in zip(after[3], before[3], strict=True)],
    }  # fmt: skip


def run_engines(
    args: argparse.Namespace,
    speculative: SpeculativeConfig,
    workload: str,
    warmup: list[Prompt],
    timed: list[Prompt],
    streams: int,
) -> tuple[EngineRun, EngineRun]:
    """Build an engine without speculation and one with it, warm both up on `warmup`, then time `timed` in waves of
    `streams` requests, each wave on both engines, first on the one and then on the other in turn: on a shared
    machine a slow spell falls on both alike. Both engines are dropped before returning."""
    from engine_server.config import EngineConfig
    from engine_server.frontend import ChatPrompt
    from engine_server.llm import LLM
    from engine_server.tokenizer.chat import ChatMessage

    def engine_prompt(prompt: Prompt) -> ChatPrompt | list[int]:
        return ChatPrompt([ChatMessage("user", prompt)]) if isinstance(prompt, str) else prompt

    runs = (EngineRun(), EngineRun())
    engines: list[Any] = []
    try:
        for config in (None, speculative):
            engine_config = EngineConfig(model=args.model, device=args.device, seed=args.seed, speculative=config)
            engines.append(LLM(config=engine_config))
            warm = [sampling_params(workload, args, i) for i in range(len(warmup))]
            engines[-1].generate([engine_prompt(p) for p in warmup], warm, use_tqdm=False)
        before = _counters(engines[1])
        for i in range(0, len(timed), streams):
            wave = [engine_prompt(p) for p in timed[i : i + streams]]
            params = [sampling_params(workload, args, len(warmup) + i + j) for j in range(len(wave))]
            order = (0, 1) if (i // streams) % 2 == 0 else (1, 0)
            for llm, run in ((engines[k], runs[k]) for k in order):
                start = time.perf_counter()
                run.outputs += [list(r.choices[0].token_ids) for r in llm.generate(wave, params, use_tqdm=False)]
                run.seconds += time.perf_counter() - start
        after = _counters(engines[1])
        if before is not None and after is not None:
            runs[1].speculation = speculation_delta(before, after)
    except Exception:  # an engine failure is this benchmark's finding: recorded, and the other cases still run
        for run in runs:
            run.error = traceback.format_exc()
    finally:
        engines.clear()
        gc.collect()
        _free_device_memory(args.device)
    return runs


def sampling_params(workload: str, args: argparse.Namespace, index: int) -> Any:
    """Greedy, except the story workload's seeded sampling (the seed from --seed and the request's index)."""
    from engine_server.sampling_params import SamplingParams

    if workload == "story":
        return SamplingParams(temperature=STORY_TEMPERATURE, max_tokens=args.max_tokens, seed=args.seed * 1000 + index)
    return SamplingParams(temperature=0.0, max_tokens=args.max_tokens)


def _free_device_memory(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


def first_differences(off: Sequence[Sequence[int]], on: Sequence[Sequence[int]]) -> list[dict[str, Any]]:
    """For each request whose outputs differ: its index, the first differing position and a few tokens from it."""
    differences = []
    for index, (a, b) in enumerate(zip(off, on, strict=True)):
        if list(a) == list(b):
            continue
        position = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        differences.append({"request": index, "position": position, "off_len": len(a), "on_len": len(b),
                            "off_tokens": list(a[position : position + 8]),
                            "on_tokens": list(b[position : position + 8])})  # fmt: skip
    return differences


def build_record(workload: str, streams: int, timed: Sequence[Prompt], off: EngineRun, on: EngineRun,
                 args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    """One (workload, streams) case's JSON object."""
    compared = off.error is None and on.error is None
    differences = first_differences(off.outputs, on.outputs) if compared else []
    for difference in differences:
        difference["prompt"] = timed[difference["request"]]
    spec = on.speculation or {}
    rate_off, rate_on = off.tok_per_s, on.tok_per_s
    return {
        "benchmark": "speculative", "workload": workload, "streams": streams, "num_requests": len(timed),
        "tok_per_s_off": rate_off, "tok_per_s_on": rate_on,
        "speedup": round(rate_on / rate_off, 3) if rate_off and rate_on else None,
        "mean_acceptance_length": spec.get("mean_acceptance_length"),
        "proposed_tokens": spec.get("proposed_tokens"), "accepted_tokens": spec.get("accepted_tokens"),
        "verified_rows": spec.get("verified_rows"), "draft_acceptance_rate": spec.get("draft_acceptance_rate"),
        "kept_histogram": spec.get("kept_histogram"),
        "identical_greedy": (not differences) if compared else None, "differences": differences,
        "error_off": off.error, "error_on": on.error,
        "output_tokens": off.output_tokens, "output_tokens_on": on.output_tokens,
        "seconds_off": round(off.seconds, 3), "seconds_on": round(on.seconds, 3),
        "speculative_config": json.loads(args.speculative_config),
        "temperature": STORY_TEMPERATURE if workload == "story" else 0.0,
        "model": args.model, "device": args.device, "max_tokens": args.max_tokens, "seed": args.seed,
        "load_average": [round(v, 2) for v in os.getloadavg()],
        "commit": args.commit, "cpu_model": cpu_model_name(), "time": utc_timestamp(), "command": args.command_line,
    }  # fmt: skip


def format_table(records: Sequence[dict[str, Any]]) -> str:
    def cell(value: Any) -> str:
        return "n/a" if value is None else str(value)

    header = ("workload", "streams", "reqs", "out tok", "off tok/s", "on tok/s", "speedup", "accept len",
              "kept/proposed", "identical")  # fmt: skip
    rows = [header] + [
        (r["workload"], str(r["streams"]), str(r["num_requests"]), str(r["output_tokens"]), cell(r["tok_per_s_off"]),
         cell(r["tok_per_s_on"]), cell(r["speedup"]), cell(r["mean_acceptance_length"]),
         f"{cell(r['accepted_tokens'])}/{cell(r['proposed_tokens'])}", cell(r["identical_greedy"]))
        for r in records
    ]  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows)


def run_case(args: argparse.Namespace, speculative: SpeculativeConfig, workload: str, streams: int) -> dict[str, Any]:
    num_requests = args.num_requests or max(4, 2 * streams)
    warmup, timed = case_prompts(workload, streams, num_requests, args.seed)
    off, on = run_engines(args, speculative, workload, warmup, timed, streams)
    record = build_record(workload, streams, timed, off, on, args)
    for name, error in (("off", off.error), ("on", on.error)):
        if error:
            print(f"{workload} x {streams} streams, speculation {name}: the engine raised\n{error}", flush=True)
    for difference in record["differences"]:
        print(
            f"{workload} x {streams} streams: request {difference['request']} differs from token "
            f"{difference['position']}: off {difference['off_tokens']} on {difference['on_tokens']}",
            flush=True,
        )
    return record


def _csv(kind: type, choices: Sequence[Any] = ()) -> Any:
    def parse(text: str) -> list[Any]:
        values = [kind(v) for v in text.split(",") if v]
        bad = [v for v in values if (choices and v not in choices) or (kind is int and v < 1)]
        if not values or bad:
            raise argparse.ArgumentTypeError(f"bad value(s) {bad or text!r}" + (f"; from {choices}" if choices else ""))
        return values

    return parse


def _speculative_config(text: str) -> str:
    try:
        SpeculativeConfig.from_json(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ladle bench speculative", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--workloads",
        type=_csv(str, WORKLOADS),
        default=list(WORKLOADS),
        help=f"comma-separated, from {','.join(WORKLOADS)} (default: all)",
    )
    parser.add_argument(
        "--streams",
        type=_csv(int),
        default=[1, 16],
        help="comma-separated numbers of requests submitted together (default: 1,16)",
    )
    parser.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="timed requests per workload and streams setting (default: max(4, 2 x streams))",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=512,
        help="output tokens per request at most (default 512: room for an edited passage whole)",
    )
    parser.add_argument(
        "--speculative-config",
        type=_speculative_config,
        default=DEFAULT_SPECULATIVE_CONFIG,
        help=f"speculation of the 'on' runs, as vLLM's JSON (default: {DEFAULT_SPECULATIVE_CONFIG})",
    )
    add_model_arguments(parser)
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompts and the engine (default 0)")
    parser.add_argument("--out", type=Path, help="append one JSON object per (workload, streams) to this .jsonl")
    return parser  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.commit = git_commit()  # once: the code this run loaded, even if the tree changes while it runs
    args.command_line = shlex.join(["ladle", "bench", "speculative", *(argv if argv is not None else sys.argv[1:])])
    speculative = SpeculativeConfig.from_json(args.speculative_config)
    records = []
    for workload in args.workloads:
        for streams in args.streams:
            record = run_case(args, speculative, workload, streams)
            append_result(args.out, record)
            records.append(record)
            print(
                f"{workload} x {streams} streams: {record['tok_per_s_off']} -> {record['tok_per_s_on']} tok/s, "
                f"acceptance length {record['mean_acceptance_length']}, identical {record['identical_greedy']}",
                flush=True,
            )
    print(format_table(records))
    return 0 if all(r["identical_greedy"] for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
