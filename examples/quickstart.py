"""Quickstart: a chat turn, a choice, and a typed value.   python examples/quickstart.py [--url URL]"""

from common import make_backend, parse_args

import lmprog as sgl


@sgl.function
def assistant_turn(s, question):
    s += sgl.system("You are a concise assistant.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=48, stop="\n\n"))
    with s.user():
        s += "Was that answer about programming? Reply yes or no."
    s += sgl.assistant(sgl.select("on_topic", ["yes", "no"]))
    s += "\nHow many sentences was your first answer? " + sgl.gen_int("sentences", max_tokens=4)


def main():
    backend = make_backend(parse_args(__doc__))
    state = assistant_turn.run(question="What is a Python decorator?", temperature=0)
    print("answer:   ", state["answer"].strip())
    print("on topic: ", state["on_topic"])
    print("sentences:", int(state["sentences"]))
    print("messages: ", [m["role"] for m in state.messages()])
    backend.shutdown()


if __name__ == "__main__":
    main()
