"""A JSON extraction job: every output validates against a schema.

    python examples/json_extraction.py [--url URL]

The schema travels to the runtime as a constraint, so the model cannot produce
anything but valid JSON of this shape.
"""

import json

from common import make_backend, parse_args

import lmprog as sgl

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "city": {"type": "string", "maxLength": 24},
        "role": {"type": "string", "enum": ["engineer", "doctor", "teacher", "other"]},
    },
    "required": ["name", "city", "role"],
    "additionalProperties": False,  # undeclared keys are allowed unless closed (JSON Schema default)
}
SENTENCES = [
    "Maria Lopez teaches chemistry at a high school in Madrid.",
    "Dr. Kenji Sato treats patients at a clinic in Osaka.",
    "Ada works on compilers in Cambridge.",
]


@sgl.function
def extract(s, sentence):
    s += sgl.system("Extract the person described in the sentence as JSON.")
    s += sgl.user(sentence)
    s += sgl.assistant(sgl.gen("person", max_tokens=96, json_schema=json.dumps(SCHEMA)))


def main():
    backend = make_backend(parse_args(__doc__))
    states = extract.run_batch([{"sentence": x} for x in SENTENCES], temperature=0)
    for sentence, state in zip(SENTENCES, states):
        print(json.dumps({"sentence": sentence, "person": json.loads(state["person"])}))
    backend.shutdown()


if __name__ == "__main__":
    main()
