"""The replay study (issue 46): the same generated data trained through each proximal anchor; resumable.

    python benchmarks/replay_study.py                          # every job not finished yet, then the report
    python benchmarks/replay_study.py --only record:8:0 replay:8:0:loglinear scale:8
    python benchmarks/replay_study.py --report                 # tables and figure from the finished jobs only

Why: in the closed-loop sweep (benchmarks/learning.py) each run samples its own data, and the paired loglinear -
recompute intervals came out 5-20x wider than the difference in question. Here the data is fixed. Jobs:
  record:D:SEED   the sweep's recipe (SmolLM2-135M-Instruct, addition, generation on a CPU vLLM server) with
                  prox_logp_method=recompute at max_staleness D, recording every generation batch it trains on
                  (`--record_generation_batches`; `trl_a3po/recording.py` has the format). Kept, with the run's log
                  and greedy accuracy, in `benchmarks/runs/replay/streams/dD-sSEED/` (the recording is ~3 MB).
  replay:D:SEED:ANCHORS
                  learners trained on that stream by `ReplayTrainer`, from the base model: recompute's and each of
                  ANCHORS's (`+`-joined: loglinear, rollout, linear; `trl_a3po.replay.ANCHORS`), in lockstep: one
                  process per learner, one training at a time, each stopped after every optimizer step while this
                  process compares them: the KL between their next-token distributions on a fixed held-out set (both
                  directions, nats per token) and the cosine between their updates (this step's change of all
                  weights). Then every learner's greedy accuracy on the 200 held-out problems. The study's jobs are
                  loglinear+rollout per stream (three learners, ~2 h alone), then linear's: one recompute learner
                  serves both comparisons (a replay is deterministic: on one machine and thread count, the recompute
                  learner of every job is the same, bit for bit). Each anchor's results, with the recompute
                  learner's, in `benchmarks/runs/replay/replays/dD-sSEED/ANCHOR/`.
  scale:D         for scale, the same KL between closed-loop runs of one method with different seeds: the recompute
                  replays of the streams of seeds 0 and 1 at D, in lockstep (each reproduces its closed-loop recording
                  run up to float rounding: a replay of the recorded anchor is that run, bit for bit, when its thread
                  count matches; tests/test_replay.py). `benchmarks/runs/replay/scale/dD/`.
Resumable: a finished job is skipped; an unfinished replay or scale job continues from the last generation batch
every learner checkpointed in outputs/replay/ (bit for bit, tests/test_replay.py), or starts over where there is none
(a fresh machine). Stop it with Ctrl-C or `kill`: either stops its learners and servers too.
The held-out set for the KL: the first 32 held-out problems, each with one completion the base model sampled once
(32 tokens, temperature 1, seed 0; `heldout.pt`), teacher-forced: KL over the next-token distribution at each of
its tokens.

What a replay shows and does not: how far the anchor alone moves learning, on data none of the replayed learners
chose except the recompute one (the recording's own method). Unclipped and uncapped, the decoupled loss's gradient
is A * pi_theta / pi_behav * grad log pi_theta whatever the anchor (w * r = pi_theta / pi_behav): the anchors differ
only where a token's ratio leaves the trust region or its behaviour weight the cap.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import multiprocessing.connection
import os
import shutil
import signal
import statistics
import sys
import time
import traceback


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import learning  # noqa: E402 (the sweep's recipe, server and greedy evaluation)


STALENESS = (8, 4, 2)  # the order jobs run in: the coarsest approximation first, as in the sweep
SEEDS = (0, 1, 2)
RECORDED_METHOD = "recompute"
SCALE_SEEDS = (0, 1)  # the seed-to-seed KL: two closed-loop runs (their recompute replays)
HELDOUT_PROBLEMS = 32
HELDOUT_TOKENS = 32
RESULTS = os.path.join(REPO, "benchmarks", "runs", "replay")


def anchors() -> tuple[str, ...]:
    from trl_a3po.replay import ANCHORS

    return ANCHORS


def stream_name(d: int, seed: int) -> str:
    return f"d{d}-s{seed}"


def all_jobs() -> list[str]:
    """Staleness-major from the largest; within one: the streams, then each stream's replay of the two anchors the
    study is for (loglinear, rollout: one job, three learners), then the seed-to-seed scale. Linear's replays come
    after every staleness's: the table needs the others first."""
    jobs = []
    for d in STALENESS:
        jobs += [f"record:{d}:{seed}" for seed in SEEDS]
        jobs += [f"replay:{d}:{seed}:loglinear+rollout" for seed in SEEDS]
        jobs.append(f"scale:{d}")
    for d in STALENESS:
        jobs += [f"replay:{d}:{seed}:linear" for seed in SEEDS]
    return jobs


def parse_job(job: str) -> tuple[str, int, list]:
    """`record:D:SEED`, `replay:D:SEED:ANCHOR[+ANCHOR...]` or `scale:D` -> (kind, D, the rest), or an error naming
    what is wrong."""
    kind, *parts = job.split(":")
    shapes = {"record": 2, "replay": 3, "scale": 1}
    if kind not in shapes or len(parts) != shapes[kind] or not all(p.isdigit() for p in parts[:2]):
        raise SystemExit(f"{job}: not a job of this study; jobs look like {' '.join(all_jobs()[:5])} ...")
    d, rest = int(parts[0]), [int(p) for p in parts[1:2]]
    if kind == "replay":
        replayed = parts[2].split("+")
        unknown = [a for a in replayed if a not in anchors() or a == RECORDED_METHOD]
        if unknown:
            others = [a for a in anchors() if a != RECORDED_METHOD]
            raise SystemExit(f"{job}: {', '.join(unknown)}? The anchors to replay beside {RECORDED_METHOD}: {others}")
        rest.append(replayed)
    return kind, d, rest


def result_folders(out: str, kind: str, d: int, rest: list) -> list[str]:
    """Where a job keeps its results; it is finished when each has a result.json (written last)."""
    if kind == "record":
        return [os.path.join(out, "streams", stream_name(d, rest[0]))]
    if kind == "replay":
        seed, replayed = rest
        return [os.path.join(out, "replays", stream_name(d, seed), anchor) for anchor in replayed]
    return [os.path.join(out, "scale", f"d{d}")]


# ---------------------------------------------------------------------------------------------- record


def record(d: int, seed: int, args, base_model: str) -> None:
    results = os.path.join(args.out, "streams", stream_name(d, seed))
    recording = os.path.join(results, "recording")
    shutil.rmtree(recording, ignore_errors=True)  # an interrupted recording starts over
    flags = learning.sweep_flags(RECORDED_METHOD, d, args, args.learning_rate)
    flags += ["--record_generation_batches", recording]
    result = learning.run_recipe(flags, RECORDED_METHOD, seed, args, base_model, results, serve=True)
    result.update(max_staleness=d, learning_rate=args.learning_rate)
    learning.write_result(results, result)


# ---------------------------------------------------------------------------------------------- held-out set


def heldout_set(args, base_model: str) -> str:
    """The teacher-forced sequences the KL is measured on, made once (committed, so every session uses the same)."""
    path = os.path.join(args.out, "heldout.pt")
    if os.path.exists(path):
        return path
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_a3po import load_gsm8k

    tokenizer = AutoTokenizer.from_pretrained(base_model)
    model = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    problems = load_gsm8k(args.dataset, "test", HELDOUT_PROBLEMS, None, True)
    rows, targets = [], []
    torch.manual_seed(0)
    for prompt in problems["prompt"]:
        prompt_ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_dict=False)
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt_ids]),
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=HELDOUT_TOKENS,
                pad_token_id=tokenizer.eos_token_id,
            )
        completion = out[0, len(prompt_ids) :].tolist()
        rows.append(prompt_ids + completion)
        # the positions whose next-token distribution is compared: those that predict a completion token
        targets.append(list(range(len(prompt_ids) - 1, len(prompt_ids) - 1 + len(completion))))
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), tokenizer.eos_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    target_mask = torch.zeros_like(input_ids, dtype=torch.bool)
    for i, (row, positions) in enumerate(zip(rows, targets)):  # right-padded: every real token at its own position
        input_ids[i, : len(row)] = torch.tensor(row)
        attention_mask[i, : len(row)] = 1
        target_mask[i, positions] = True
    os.makedirs(args.out, exist_ok=True)
    torch.save({"input_ids": input_ids, "attention_mask": attention_mask, "target_mask": target_mask}, path)
    return path


def heldout_logprobs(model, heldout: dict, temperature: float, rows_at_once: int = 4):
    """(positions, vocabulary) next-token log-probs at the held-out set's target positions, float32."""
    import torch

    parts = []
    with torch.no_grad():
        for start in range(0, heldout["input_ids"].size(0), rows_at_once):
            rows = slice(start, start + rows_at_once)
            logits = model(input_ids=heldout["input_ids"][rows], attention_mask=heldout["attention_mask"][rows]).logits
            parts.append(torch.log_softmax(logits[heldout["target_mask"][rows]].float() / temperature, dim=-1))
    return torch.cat(parts)


# ---------------------------------------------------------------------------------------------- lockstep


def learner_main(spec: dict, conn) -> None:
    """One learner's process: a ReplayTrainer that reports after every optimizer step and waits for the go-ahead."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

        from trl_a3po import load_gsm8k
        from trl_a3po.recording import Recording
        from trl_a3po.replay import ReplayTrainer, replay_config

        torch.set_num_threads(spec["threads"])
        libc = ctypes.CDLL("libc.so.6")
        heldout = torch.load(spec["heldout"], weights_only=True)

        class Lockstep(TrainerCallback):
            def on_train_begin(self, args, state, control, model=None, **kwargs):
                self.previous = torch.cat([p.detach().flatten().float() for p in model.parameters()])
                self.wait_for_turn()

            def wait_for_turn(self):
                # Every learner of a job stays resident; each would keep its peak (the step's freed activations), as
                # glibc holds freed memory for reuse: hand it back to the system while waiting.
                libc.malloc_trim(0)
                if conn.recv() != "go":
                    raise RuntimeError("the study stopped this learner")

            def on_step_end(self, args, state, control, model=None, **kwargs):
                current = torch.cat([p.detach().flatten().float() for p in model.parameters()])
                update = current - self.previous
                self.previous = current
                logp = heldout_logprobs(model, heldout, trainer.temperature)
                conn.send(("step", state.global_step, update.share_memory_(), logp.share_memory_()))
                self.wait_for_turn()

        tokenizer = AutoTokenizer.from_pretrained(spec["base_model"])
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        model = AutoModelForCausalLM.from_pretrained(spec["base_model"], dtype=torch.float32)
        dataset = load_gsm8k(spec["dataset"], "train", None, None, True)  # the recipe's training set
        recorded = Recording(spec["recording"]).config
        optimizer_steps_per_version = (
            recorded["steps_per_generation"] * recorded["num_iterations"] // recorded["gradient_accumulation_steps"]
        )
        args = replay_config(
            spec["recording"],
            spec["anchor"],
            spec["out"],
            logging_steps=1,
            # a checkpoint after every generation batch's training step (the last two kept): a job stopped with its
            # session resumes from the last one every learner saved (`resume_point`), bit for bit; recompute's
            # anchor is not in a checkpoint taken inside a batch (tests/test_replay.py)
            save_strategy="steps",
            save_steps=optimizer_steps_per_version,
            save_total_limit=2,
            report_to="none",
            disable_tqdm=True,
        )
        trainer = ReplayTrainer(
            model,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            recording=spec["recording"],
            anchor=spec["anchor"],
            callbacks=[Lockstep()],
        )
        conn.send(("ready",))
        trainer.train(resume_from_checkpoint=spec["resume_from"])
        trainer.save_model(os.path.join(spec["out"], "model"))
        trainer.save_state()  # trainer_state.json in `out`: this learner is trained (`trained`)
        conn.send(("done",))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise


def receive(conn, process, label: str):
    """The learner's next message, or an error naming it if its process ends without one."""
    multiprocessing.connection.wait([conn, process.sentinel])
    if conn.poll():
        message = conn.recv()
        if message[0] == "error":
            raise RuntimeError(f"learner {label} failed:\n{message[1]}")
        return message
    raise RuntimeError(f"learner {label} exited (code {process.exitcode}) without a word; see its train.log")


def trained(spec: dict) -> bool:
    return os.path.exists(os.path.join(spec["out"], "trainer_state.json"))


def checkpoints(out: str) -> dict[int, str]:
    """A learner's complete checkpoints by step (the Trainer writes trainer_state.json last)."""
    found = {}
    for name in os.listdir(out) if os.path.isdir(out) else []:
        path = os.path.join(out, name)
        if name.startswith("checkpoint-") and os.path.exists(os.path.join(path, "trainer_state.json")):
            found[int(name.split("-")[1])] = path
    return found


def resume_point(learners: dict[str, dict], steps_path: str) -> int:
    """The last optimizer step every learner has a checkpoint of (0: start over): set each spec's `resume_from`
    and keep `steps_path`'s rows up to that step."""
    saved = [checkpoints(spec["out"]) for spec in learners.values()]
    common = set.intersection(*(set(found) for found in saved))
    step = max(common, default=0)
    for spec, found in zip(learners.values(), saved):
        spec["resume_from"] = found.get(step)
    rows = []
    if step and os.path.exists(steps_path):
        with open(steps_path) as f:
            rows = [line for line in f if json.loads(line)["step"] <= step]
    if len(rows) != step:  # (the rows are written after every learner reported, the checkpoints after that)
        raise RuntimeError(f"{steps_path} has {len(rows)} rows up to the checkpoints' step {step}: start the job over")
    os.makedirs(os.path.dirname(steps_path), exist_ok=True)  # a new job: its folder does not exist yet
    with open(steps_path, "w") as f:
        f.writelines(rows)
    return step


def dot(a, b) -> float:
    """float64 dot product of two float32 vectors, a slice at a time (whole float64 copies of three learners'
    updates would take 3 GB). float64: learners differ by ~1e-9 where no token clipped, below float32's rounding
    over 135M weights (it gave cosine 1.02)."""
    chunk = 1 << 24
    return sum((a[i : i + chunk].double() @ b[i : i + chunk].double()).item() for i in range(0, a.numel(), chunk))


def lockstep(learners: dict[str, dict], steps_path: str, reference: str) -> None:
    """Train `learners` (label -> spec) in lockstep, from their last common checkpoint; after each optimizer step
    write one line to `steps_path`: the KL between every two learners both ways (`kl[a][b]` = KL(a || b), nats per
    held-out token), the cosine between their updates, each update's norm, and the job's training time so far."""
    import torch.multiprocessing as mp

    if all(trained(spec) for spec in learners.values()):
        return
    first = resume_point(learners, steps_path)
    elapsed = 0.0
    if first:
        with open(steps_path) as f:
            elapsed = [json.loads(line) for line in f][-1]["elapsed_s"]
        print(f"  resuming after step {first}", flush=True)
    start = time.perf_counter() - elapsed
    context = mp.get_context("spawn")
    processes, connections = {}, {}
    for label, spec in learners.items():
        os.makedirs(spec["out"], exist_ok=True)
        parent, child = context.Pipe()
        process = context.Process(target=learner_main, args=(spec, child), name=f"replay-{label}", daemon=True)
        process.start()
        processes[label], connections[label] = process, parent
    labels = list(learners)
    try:
        for label in labels:  # loaded (in parallel), waiting for their first turn
            receive(connections[label], processes[label], label)
        with open(steps_path, "a") as steps:
            while True:
                messages = {}
                for label in labels:  # one learner trains at a time: four at once exhausted 24 GB at their peaks
                    connections[label].send("go")
                    messages[label] = receive(connections[label], processes[label], label)
                kinds = {message[0] for message in messages.values()}
                if kinds == {"done"}:
                    break
                if kinds != {"step"} or len({message[1] for message in messages.values()}) != 1:
                    raise RuntimeError(f"learners out of step: { {k: m[:2] for k, m in messages.items()} }")
                step = messages[labels[0]][1]
                updates = {label: message[2] for label, message in messages.items()}
                # float64: learners differ by ~1e-9 nats where no token clipped, below float32's rounding over a
                # 49k vocabulary (it gave KL -3e-9)
                logps = {label: message[3].double() for label, message in messages.items()}
                norms = {label: math.sqrt(dot(updates[label], updates[label])) for label in labels}
                row = {"step": step, "reference": reference, "kl": {}, "cosine": {}, "update_norm": norms}
                for a in labels:
                    probs = logps[a].exp()
                    row["kl"][a] = {b: (probs * (logps[a] - logps[b])).sum(-1).mean().item() for b in labels if b != a}
                    row["cosine"][a] = {  # None where a learner did not move (a batch whose advantages are all 0)
                        b: dot(updates[a], updates[b]) / (norms[a] * norms[b]) if norms[a] * norms[b] > 0 else None
                        for b in labels
                        if b != a
                    }
                row["elapsed_s"] = round(time.perf_counter() - start, 1)
                steps.write(json.dumps(row) + "\n")
                steps.flush()
                print(
                    f"  step {step}: KL to {reference} "
                    + ", ".join(f"{b} {row['kl'][reference][b]:.2e}" for b in labels if b != reference),
                    flush=True,
                )
                del updates, logps, messages
    finally:
        for label, process in processes.items():  # (after an error: a learner waiting for "go" gets "stop")
            if process.is_alive():
                try:
                    connections[label].send("stop")
                except OSError:
                    pass
                process.join(timeout=60)
            if process.is_alive():
                process.kill()
                process.join()
    for spec in learners.values():  # ~1.6 GB each: only an unfinished job needs them
        for path in checkpoints(spec["out"]).values():
            shutil.rmtree(path)


def learner_spec(args, base_model: str, recording: str, anchor: str, out: str, threads: int) -> dict:
    return {
        "base_model": base_model,
        "dataset": args.dataset,
        "recording": recording,
        "anchor": anchor,
        "out": out,
        "heldout": heldout_set(args, base_model),
        "threads": threads,
        "resume_from": None,  # set by `resume_point`
    }


def add_comparisons(state_path: str, steps_path: str, label: str) -> None:
    """Each optimizer step's KL to the reference learner (both ways) and update cosine, into the learner's log as
    `replay/kl_reference_learner`, `replay/kl_learner_reference`, `replay/update_cosine` (`trl_a3po.plot` draws
    the first)."""
    with open(steps_path) as f:
        rows = {row["step"]: row for row in map(json.loads, f)}
    with open(state_path) as f:
        state = json.load(f)
    for entry in state["log_history"]:
        row = rows.get(entry.get("step"))
        if row is None or "loss" not in entry or label == row["reference"]:
            continue
        reference = row["reference"]
        entry["replay/kl_reference_learner"] = row["kl"][reference][label]
        entry["replay/kl_learner_reference"] = row["kl"][label][reference]
        if row["cosine"][label][reference] is not None:
            entry["replay/update_cosine"] = row["cosine"][label][reference]
    with open(state_path, "w") as f:
        json.dump(state, f, indent=1)


def keep_learner_results(out: str, results: str, label: str, steps_path: str) -> None:
    os.makedirs(results, exist_ok=True)
    shutil.copy(os.path.join(out, "trainer_state.json"), results)
    add_comparisons(os.path.join(results, "trainer_state.json"), steps_path, label)


def learner_greedy_accuracy(args, spec: dict) -> dict:
    """The trained learner's greedy accuracy on the held-out problems (kept in its folder: a resumed job evaluates
    only the learners it has not)."""
    path = os.path.join(spec["out"], "greedy_accuracy.json")
    if not os.path.exists(path):
        after = learning.greedy_accuracy(
            os.path.join(spec["out"], "model"),
            args.dataset,
            args.eval_limit,
            args.port + 1,
            os.path.join(spec["out"], "vllm-eval"),
        )
        with open(path, "w") as f:
            json.dump(after, f)
    with open(path) as f:
        return json.load(f)


def replay(d: int, seed: int, replayed: list[str], args, base_model: str) -> None:
    """The recompute learner and each of `replayed`'s anchors not finished yet on one stream, in lockstep; each
    anchor's results (with the recompute learner's) in its own folder, as if replayed in a job of two."""
    name = stream_name(d, seed)
    recording = os.path.join(args.out, "streams", name, "recording")
    if not os.path.exists(os.path.join(args.out, "streams", name, "result.json")):
        raise RuntimeError(f"replaying {name} needs the stream: run record:{d}:{seed} first")
    replayed = [a for a in replayed if not os.path.exists(os.path.join(args.out, "replays", name, a, "result.json"))]
    labels = [RECORDED_METHOD, *replayed]
    # the same learners on the same stream work in the same folder: a stopped job resumes there
    work = os.path.join(REPO, "outputs", "replay", name, "+".join(labels))
    learners = {
        label: learner_spec(args, base_model, recording, label, os.path.join(work, label), args.threads)
        for label in labels
    }
    steps_path = os.path.join(work, "steps.jsonl")
    print(f"[{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}] replay {name}: {', '.join(labels)}", flush=True)
    lockstep(learners, steps_path, reference=RECORDED_METHOD)
    with open(steps_path) as f:
        replay_s = [json.loads(line) for line in f][-1]["elapsed_s"]
    before = learning.base_accuracy(args, base_model)
    after = {label: learner_greedy_accuracy(args, spec) for label, spec in learners.items()}
    for anchor in replayed:
        results = os.path.join(args.out, "replays", name, anchor)
        os.makedirs(results, exist_ok=True)
        shutil.copy(steps_path, results)
        summary = {
            "stream": name,
            "max_staleness": d,
            "seed": seed,
            "replay_s": replay_s,
            "learners_in_job": labels,
            "learners": {},
        }
        for label in (RECORDED_METHOD, anchor):
            keep_learner_results(learners[label]["out"], os.path.join(results, label), label, steps_path)
            with open(os.path.join(results, label, "greedy_eval.json"), "w") as f:
                json.dump([{"step": 0, **before}, {"step": args.steps, **after[label]}], f, indent=1)
            state = os.path.join(results, label, "trainer_state.json")
            summary["learners"][label] = learner_summary(state, after[label])
        with open(os.path.join(results, "result.json"), "w") as f:  # written last: marks the anchor finished
            json.dump(summary, f, indent=1)


def learner_summary(state_path: str, after: dict) -> dict:
    with open(state_path) as f:
        logs = [h for h in json.load(f)["log_history"] if "loss" in h]

    def mean(key):
        values = [h[key] for h in logs if key in h]
        return statistics.mean(values) if values else None

    return {
        "greedy_after": after["accuracy"],
        "kl_reference_learner": mean("replay/kl_reference_learner"),
        "kl_learner_reference": mean("replay/kl_learner_reference"),
        "update_cosine": mean("replay/update_cosine"),
        "clip_frac": mean("clip_ratio/region_mean"),
        "behav_weight_mean": mean("a3po/behav_imp_weight/mean"),
        "capped_frac": mean("a3po/capped_frac"),
        "steps": len(logs),
    }


def scale(d: int, args, base_model: str) -> None:
    streams = {s: os.path.join(args.out, "streams", stream_name(d, s)) for s in SCALE_SEEDS}
    missing = [s for s, stream in streams.items() if not os.path.exists(os.path.join(stream, "result.json"))]
    if missing:
        raise RuntimeError(f"scale:{d} needs the streams of seeds {missing}: run their record jobs first")
    results = os.path.join(args.out, "scale", f"d{d}")
    work = os.path.join(REPO, "outputs", "replay", f"scale-d{d}")  # a stopped job resumes there
    os.makedirs(results, exist_ok=True)
    learners = {
        f"s{s}": learner_spec(
            args,
            base_model,
            os.path.join(streams[s], "recording"),
            RECORDED_METHOD,
            os.path.join(work, f"s{s}"),
            args.threads,
        )
        for s in SCALE_SEEDS
    }
    print(f"[{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}] scale d{d}: {', '.join(learners)}", flush=True)
    steps_path = os.path.join(work, "steps.jsonl")
    lockstep(learners, steps_path, reference=f"s{SCALE_SEEDS[0]}")
    shutil.copy(steps_path, results)
    for label, spec in learners.items():
        keep_learner_results(spec["out"], os.path.join(results, label), label, steps_path)
    with open(steps_path) as f:
        rows = [json.loads(line) for line in f]
    pairs = [(a, b) for a in learners for b in learners if a < b]
    summary = {
        "max_staleness": d,
        "replay_s": rows[-1]["elapsed_s"],
        "kl_mean": {f"{a}|{b}": statistics.mean(row["kl"][a][b] for row in rows) for a, b in pairs},
        "kl_mean_reverse": {f"{a}|{b}": statistics.mean(row["kl"][b][a] for row in rows) for a, b in pairs},
    }
    with open(os.path.join(results, "result.json"), "w") as f:
        json.dump(summary, f, indent=1)


# ---------------------------------------------------------------------------------------------- report


def load(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def update_norm_ratio(steps_path: str, anchor: str) -> float:
    """How far a learner moved over a job, against the recompute learner: the sum of its per-step update norms over
    recompute's (Adam's step size is the same for both; an anchor changes where a learner goes, not how far)."""
    with open(steps_path) as f:
        rows = [json.loads(line) for line in f]
    moved = math.fsum(row["update_norm"][anchor] for row in rows)
    return moved / math.fsum(row["update_norm"][RECORDED_METHOD] for row in rows)


def logged_steps(state_path: str) -> list[tuple] | None:
    """A run's (step, loss, grad norm) at every logged optimizer step, from its trainer_state.json."""
    state = load(state_path)
    if state is None:
        return None
    return [(row["step"], row["loss"], row["grad_norm"]) for row in state["log_history"] if "loss" in row]


def report_reproduction(args, jobs: list[str]) -> None:
    """Replaying the recorded anchor must reproduce the recorded run: every replay job's recompute learner against its
    stream's recording run, step by step (the round-trip test's invariant, checked on the study's own runs)."""
    same, differ = 0, []
    for job in jobs:
        stream = os.path.basename(os.path.dirname(job))
        recorded = logged_steps(os.path.join(args.out, "streams", stream, "trainer_state.json"))
        replayed = logged_steps(os.path.join(job, RECORDED_METHOD, "trainer_state.json"))
        if recorded is None or replayed is None:
            continue
        if recorded == replayed:
            same += 1
        else:
            differ.append(os.path.relpath(job, os.path.join(args.out, "replays")))
    if same or differ:
        line = f"Recompute learners equal to their recorded runs (loss and grad norm, every step): {same} of "
        print(line + f"{same + len(differ)} replay jobs" + (f"; not: {', '.join(differ)}" if differ else ""))


def report_streams(args) -> None:
    """The recorded streams: each recording run's own learning (its greedy accuracy is recompute's learner's on that
    stream in every replay job), and the share of its tokens at the staleness bound."""
    print("Recorded streams (prox_logp_method=recompute; the recording runs themselves):")
    print(f"{'stream':<7} {'greedy before -> after':<23} {'accuracy reward first 3 -> last 3 steps':<40} tokens at d")
    for d in STALENESS:
        for seed in SEEDS:
            run = load(os.path.join(args.out, "streams", stream_name(d, seed), "result.json"))
            if run is None:
                continue
            greedy = f"{run['greedy_before']:.3f} -> {run['greedy_after']:.3f}"
            reward = f"{run['accuracy_reward_first3']:.3f} -> {run['accuracy_reward_last3']:.3f}"
            print(f"{stream_name(d, seed):<7} {greedy:<23} {reward:<40} {run['staleness_share'][str(d)]:.2f}")


def report(args) -> None:
    report_streams(args)
    print(
        f"Replay study: greedy accuracy on the {args.eval_limit} held-out problems after {args.steps} steps, each "
        "anchor's learner and the recompute learner of the same job (mean +- std over streams); per-step KL to that "
        "recompute learner on the held-out set (nats/token, mean over steps and streams)"
    )
    header = f"{'d':>2} {'anchor':<10} {'streams':>7}  {'greedy':<14} {'recompute':<14} {'KL(rec||x)':>10}"
    print(header + f" {'KL(x||rec)':>10} {'cos(upd)':>8} {'upd/rec':>8} {'clipped':>8} {'capped':>8}")
    figure_runs, figure_labels, differences, finished_jobs = [], [], [], []
    for d in STALENESS:
        anchor_kl = {}  # anchor -> its mean KL(recompute || anchor), against the seed-to-seed KL below
        for anchor in anchors():
            if anchor == RECORDED_METHOD:
                continue
            jobs = [os.path.join(args.out, "replays", stream_name(d, s), anchor) for s in SEEDS]
            jobs = [job for job in jobs if os.path.exists(os.path.join(job, "result.json"))]  # the finished ones
            if not jobs:
                continue
            finished_jobs += jobs
            results = [load(os.path.join(job, "result.json")) for job in jobs]
            rows = [r["learners"][anchor] for r in results]
            references = [r["learners"][RECORDED_METHOD] for r in results]

            def spread(values):
                if len(values) == 1:
                    return f"{values[0]:.3f}"
                return f"{statistics.mean(values):.3f} +- {statistics.stdev(values):.3f}"

            def average(key):
                values = [row[key] for row in rows if row[key] is not None]
                return statistics.mean(values) if values else math.nan

            greedy = [row["greedy_after"] for row in rows]
            greedy_reference = [row["greedy_after"] for row in references]
            moved = statistics.mean(update_norm_ratio(os.path.join(job, "steps.jsonl"), anchor) for job in jobs)
            anchor_kl[anchor] = average("kl_reference_learner")
            print(
                f"{d:>2} {anchor:<10} {len(rows):>7}  {spread(greedy):<14} {spread(greedy_reference):<14} "
                f"{anchor_kl[anchor]:>10.2e} {average('kl_learner_reference'):>10.2e} "
                f"{average('update_cosine'):>8.4f} {moved:>8.3f} {average('clip_frac'):>8.4f} "
                f"{average('capped_frac'):>8.4f}"
            )
            diffs = [a - b for a, b in zip(greedy, greedy_reference)]
            differences.append(f"   d={d} {anchor} - {RECORDED_METHOD}: {learning.paired_difference(diffs)}")
            for job in jobs:
                if os.path.exists(os.path.join(job, anchor, "trainer_state.json")):
                    figure_runs.append(os.path.join(job, anchor))
                    figure_labels.append(f"d={d} {anchor}")
        seed_scale = load(os.path.join(args.out, "scale", f"d{d}", "result.json"))
        if seed_scale:
            (pair, kl), *_ = seed_scale["kl_mean"].items()
            differences.append(f"   d={d} seed to seed ({pair}, closed-loop recompute runs): KL {kl:.2e} nats/token")
            for anchor, anchor_mean in anchor_kl.items():  # the study's goal: each anchor's KL 10x below this
                differences.append(f"     {anchor}'s KL to recompute: {anchor_mean / kl:.3g} x the seed-to-seed KL")
            learner = os.path.join(args.out, "scale", f"d{d}", pair.split("|")[1])
            if os.path.exists(os.path.join(learner, "trainer_state.json")):
                figure_runs.append(learner)
                figure_labels.append(f"d={d} seed to seed")
        else:
            differences.append(f"   d={d} seed to seed: not measured yet (scale:{d})")
    report_reproduction(args, finished_jobs)
    print("Paired differences of greedy accuracy (same stream), 95% interval over streams:")
    print("\n".join(differences))
    if figure_runs:
        from trl_a3po.plot import plot_runs

        written = plot_runs(figure_runs, args.figures, figure_labels)
        print("figures:", ", ".join(os.path.relpath(p, REPO) for p in written))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--only",
        nargs="+",
        metavar="JOB",
        help="these jobs only (record:8:0, replay:8:0:loglinear+rollout, replay:8:0:linear, scale:8)",
    )
    parser.add_argument("--report", action="store_true", help="no training: the tables and figure of finished jobs")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per recording (the sweep's)")
    parser.add_argument("--learning-rate", type=float, default=learning.LEARNING_RATE)
    parser.add_argument("--eval-limit", type=int, default=200, help="held-out problems for greedy accuracy")
    parser.add_argument("--dataset", default=os.path.join(REPO, "recipes", "data", "addition"))
    parser.add_argument("--out", default=RESULTS, help="where finished jobs are kept (and looked for)")
    parser.add_argument(
        "--results",
        default=os.path.join(REPO, "benchmarks", "runs", "sweep"),
        help="where the base model's greedy accuracy is kept (the sweep's measurement, same model and problems)",
    )
    parser.add_argument("--figures", default=os.path.join(REPO, "benchmarks", "figures", "replay"))
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="torch threads per learner (one trains at a time)"
    )
    parser.add_argument("--port", type=int, default=8051, help="recording server; the evaluation server uses +1")
    args = parser.parse_args()
    jobs = [(job, parse_job(job)) for job in args.only or all_jobs()]  # (a typo fails here, before any work)
    if not args.report:
        if not os.path.exists(learning.VLLM_PYTHON):
            raise SystemExit(f"{learning.VLLM_PYTHON} not found: run `bash scripts/setup.sh --with-vllm` first")
        from trl_a3po import resolve_model

        base_model = resolve_model("smollm2-135m-instruct")
        # `kill` (how a long run is stopped) unwinds like Ctrl-C: the learners and servers are stopped on the way out
        # rather than left training with no one to answer (a learner it orphaned ran on until its next report)
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(f"stopped by signal {signum}"))
        for job, (kind, d, rest) in jobs:
            finished = result_folders(args.out, kind, d, rest)
            if all(os.path.exists(os.path.join(folder, "result.json")) for folder in finished):
                print(f"{job}: finished, skipped", flush=True)
                continue
            {"record": record, "replay": replay, "scale": scale}[kind](d, *rest, args, base_model)
    report(args)


if __name__ == "__main__":
    main()
