"""milepost's own terminal tasks: each has starting files, an instruction, a test script that
grades the final state of the workspace (exit 0 = solved), and a reference solution that the
tests use to show every task is solvable and its test is not passed by the starting state."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class TerminalTask:
    name: str
    instruction: str
    test: str  # a /bin/sh script run in the workspace after the episode
    solution: str  # a /bin/sh command that solves the task (for the task-set tests)
    files: dict[str, str] = field(default_factory=dict)


_NUMBERS = "".join(f"{n}\n" for n in (17, 4, 99, 23, 8, 42, 15))
_WORDS = "pear\napple\nfig\napple\nkiwi\npear\nplum\n"

TASKS: tuple[TerminalTask, ...] = (
    TerminalTask("create_file", "Create a file hello.txt containing exactly the line: hello world",
                 'test "$(cat hello.txt)" = "hello world"', "echo 'hello world' > hello.txt"),
    TerminalTask("count_lines", "Write the number of lines of data.txt into count.txt.",
                 'test "$(tr -d " \\n" < count.txt)" = "7"', "wc -l < data.txt > count.txt",
                 {"data.txt": _NUMBERS}),
    TerminalTask("sum_numbers", "numbers.txt has one integer per line. Write their sum into "
                 "sum.txt.", 'test "$(tr -d " \\n" < sum.txt)" = "208"',
                 "s=0; while read n; do s=$((s+n)); done < numbers.txt; echo $s > sum.txt", {"numbers.txt": _NUMBERS}),
    TerminalTask("sort_unique", "Write the distinct lines of words.txt, sorted, to sorted.txt.",
                 'printf "apple\\nfig\\nkiwi\\npear\\nplum\\n" | cmp -s - sorted.txt',
                 "sort -u words.txt > sorted.txt", {"words.txt": _WORDS}),
    TerminalTask("rename", "Rename draft.md to final.md.",
                 'test -f final.md && ! test -e draft.md && grep -q "v1" final.md',
                 "mv draft.md final.md", {"draft.md": "report v1\n"}),
    TerminalTask("make_dirs", "Create the directories src/app and tests, and an empty file "
                 "src/app/__init__.py.", "test -d tests && test -f src/app/__init__.py",
                 "mkdir -p src/app tests && touch src/app/__init__.py"),
    TerminalTask("replace_text", "In config.ini, change the value of port from 8080 to 9090; "
                 "leave the other lines as they are.",
                 'grep -qx "port=9090" config.ini && grep -qx "host=localhost" config.ini && '
                 '! grep -q 8080 config.ini',
                 "sed -i 's/^port=8080$/port=9090/' config.ini",
                 {"config.ini": "host=localhost\nport=8080\ndebug=false\n"}),
    TerminalTask("delete_logs", "Delete every .log file in the workspace and keep the others.",
                 "! ls *.log >/dev/null 2>&1 && test -f keep.txt && test -f notes.md",
                 "rm -f *.log", {"a.log": "x\n", "b.log": "y\n", "keep.txt": "k\n",
                                 "notes.md": "n\n"}),
    TerminalTask("executable_script", "Create an executable script run.sh that prints ok.",
                 'test -x run.sh && test "$(./run.sh)" = "ok"',
                 "printf '#!/bin/sh\\necho ok\\n' > run.sh && chmod +x run.sh"),
    TerminalTask("max_value", "Write the largest number in numbers.txt into max.txt.",
                 'test "$(tr -d " \\n" < max.txt)" = "99"', "sort -n numbers.txt | tail -1 > "
                 "max.txt", {"numbers.txt": _NUMBERS}),
    TerminalTask("count_word", "Write how many lines of words.txt are exactly apple into "
                 "apples.txt.", 'test "$(tr -d " \\n" < apples.txt)" = "2"',
                 "grep -cx apple words.txt > apples.txt", {"words.txt": _WORDS}),
    TerminalTask("json_field", "user.json holds a JSON object. Write the value of its name field "
                 "(without quotes) into name.txt.", 'test "$(cat name.txt)" = "Ada"',
                 "sed -n 's/.*\"name\": *\"\\([^\"]*\\)\".*/\\1/p' user.json > name.txt",
                 {"user.json": json.dumps({"id": 7, "name": "Ada", "role": "admin"}) + "\n"}),
)



# The easy tier (issue 25 item 4): one-command goals, so a 135M model's first call can solve one
# and GRPO sees groups with both outcomes (the 12 above: 0 of 96 SmolLM2 episodes). Each kind is
# instantiated with several names; the first five of each kind train, the other three are held
# out (`easy_heldout`): the same commands on names the policy was never rewarded on. Binary
# grades only: the tests also check what must survive (keep.txt, the source of a copy), so a
# blanket `rm -rf *` or `touch *` earns nothing, and no part marks for a well-formed call (that
# would pay for the format, not the goal).
_EASY_KINDS: tuple[tuple[str, str, str, str, dict[str, str], tuple[str, ...]], ...] = (
    # kind, instruction, test, solution, files ({n} = the name), names
    ("touch", "Create an empty file named {n}.", "test -f {n}", "touch {n}", {},
     ("notes.txt", "todo.txt", "data.csv", "main.py", "index.html", "list.txt", "report.md",
      "app.log")),
    ("mkdir", "Create a directory named {n}.", "test -d {n}", "mkdir {n}", {},
     ("build", "docs", "src", "logs", "images", "backup", "output", "scripts")),
    ("rm", "Delete the file {n}.", "! test -e {n} && test -f keep.txt", "rm {n}",
     {"{n}": "old\n", "keep.txt": "keep\n"},
     ("old.txt", "temp.txt", "junk.log", "draft.md", "cache.tmp", "error.log", "copy.txt",
      "test.py")),
    ("cp", "Copy the file {n} to backup_{n}.", "test -f {n} && cmp -s {n} backup_{n}",
     "cp {n} backup_{n}", {"{n}": "line one\nline two\n"},
     ("notes.txt", "data.csv", "config.ini", "main.py", "todo.txt", "readme.md", "list.txt",
      "report.md")),
    ("echo", "Write the word {n} into the file word.txt.",
     'test "$(tr -d " \\n" < word.txt)" = "{n}"', "echo {n} > word.txt", {},
     ("hello", "apple", "green", "python", "river", "orange", "tiger", "music")),
    ("mv", "Rename the file {n} to new_{n}.", "test -f new_{n} && ! test -e {n}",
     "mv {n} new_{n}", {"{n}": "text\n"},
     ("notes.txt", "data.csv", "photo.png", "main.py", "todo.txt", "song.mp3", "plan.md",
      "list.txt")),
)
_EASY_TRAIN_NAMES = 5


def _easy(held_out: bool) -> tuple[TerminalTask, ...]:
    tasks = []
    for kind, instruction, test, solution, files, names in _EASY_KINDS:
        picked = names[_EASY_TRAIN_NAMES:] if held_out else names[:_EASY_TRAIN_NAMES]
        for n in picked:
            tasks.append(TerminalTask(
                f"easy_{kind}_{n}", instruction.format(n=n), test.format(n=n),
                solution.format(n=n), {k.format(n=n): v for k, v in files.items()}))
    return tuple(tasks)


EASY_TASKS = _easy(held_out=False)
EASY_HELDOUT_TASKS = _easy(held_out=True)
TIERS: dict[str, tuple[TerminalTask, ...]] = {
    "standard": TASKS, "easy": EASY_TASKS, "easy_heldout": EASY_HELDOUT_TASKS}
TASKS_BY_NAME = {t.name: t for tier in TIERS.values() for t in tier}


def write_task_prompts(path: str | Path, tier: str = "standard") -> Path:
    """A prompt dataset of one tier of the task set for `milepost train` (prompt = instruction,
    label = name): `standard` (the 12 above), `easy` or `easy_heldout`."""
    if tier not in TIERS:
        raise ValueError(f"tier {tier!r} is not one of {sorted(TIERS)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": t.instruction, "label": t.name}) + "\n"
                            for t in TIERS[tier]))
    return path


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Write the terminal task set as a prompt dataset.")
    ap.add_argument("path", help="JSONL file to write (prompt = instruction, label = task name)")
    ap.add_argument("--tier", default="standard", choices=sorted(TIERS),
                    help="which tasks: the 12 standard ones, or the easy tier's train or "
                         "held-out part")
    args = ap.parse_args(argv)
    print(write_task_prompts(args.path, args.tier))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
