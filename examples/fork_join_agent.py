"""A fork/join agent: plan, research each step in parallel branches, then conclude.

    python examples/fork_join_agent.py [--url URL] [--task "..."]

The branches share the planning prefix: `fork` commits it to the server's prefix cache
before they start, so each branch only pays for its own tokens.
"""

from common import make_backend, parse_args

import lmprog as sgl

NUM_STEPS = 3


@sgl.function
def agent(s, task):
    s += sgl.system("You are a careful planner. Keep every line short.")
    with s.user():
        s += f"Task: {task}\nList {NUM_STEPS} steps, one per line."
    with s.assistant():
        for i in range(NUM_STEPS):
            s += f"{i + 1}." + sgl.gen(f"step_{i}", max_tokens=16, stop="\n") + "\n"
    branches = s.fork(NUM_STEPS)
    for i, branch in enumerate(branches):
        branch += sgl.user(f"Explain step {i + 1} in one sentence.")
        branch += sgl.assistant(sgl.gen("detail", max_tokens=32, stop="\n"))
    branches.join()  # s["detail"] is now the list of the branches' details
    s += sgl.user("Given the details, what is the first thing to do?")
    s += sgl.assistant(sgl.gen("conclusion", max_tokens=32, stop="\n"))


def main():
    args = parse_args(__doc__, lambda p: p.add_argument("--task", default="Organize a small conference."))
    backend = make_backend(args)
    state = agent.run(task=args.task, temperature=0)
    for i, detail in enumerate(state["detail"]):
        print(f"step {i + 1}: {state[f'step_{i}'].strip()}\n   detail: {detail.strip()}")
    print("conclusion:", state["conclusion"].strip())
    backend.shutdown()


if __name__ == "__main__":
    main()
