"""Offline batch: many programs at once, with the shared few-shot prefix warmed once.

    python examples/offline_batch.py [--url URL] [--n 32]
"""

import time

from common import make_backend, parse_args

import lmprog as sgl

FEW_SHOT = ("Answer with the capital city.\n"
            "Country: France\nCapital: Paris\n"
            "Country: Japan\nCapital: Tokyo\n"
            "Country: Kenya\nCapital: Nairobi\n")
COUNTRIES = ["Italy", "Spain", "Egypt", "Peru", "Canada", "India", "Norway", "Chile"]


@sgl.function
def capital(s, country):
    s += FEW_SHOT
    s += "Country: " + country + "\nCapital:" + sgl.gen("capital", max_tokens=8, stop="\n")


def main():
    args = parse_args(__doc__, lambda p: p.add_argument("--n", type=int, default=32))
    backend = make_backend(args)
    batch = [{"country": COUNTRIES[i % len(COUNTRIES)]} for i in range(args.n)]
    start = time.perf_counter()
    # run_batch traces `capital`, sends FEW_SHOT once as a zero-token request, then runs all programs.
    states = capital.run_batch(batch, temperature=0, progress_bar=True)
    elapsed = time.perf_counter() - start
    for item, state in list(zip(batch, states))[:len(COUNTRIES)]:
        print(f"{item['country']:>8}: {state['capital'].strip()}")
    print(f"{len(states)} programs in {elapsed:.2f} s ({len(states) / elapsed:.1f} programs/s)")
    backend.shutdown()


if __name__ == "__main__":
    main()
