"""A child process for tests/server/test_grammar_limits.py: parse a chat grammar with llama.cpp
on a thread of a chosen stack size, then walk it with a few tokens, and exit 0.

    python grammar_child.py (schema|raw|gbnf) SOURCE STACK_BYTES TEXT

`schema`: SOURCE is a JSON schema, made into a grammar as the server does (decider.engine.chat_options,
default limits); `raw`: the same through llama.cpp's converter alone, as the server did before the
limits; `gbnf`: SOURCE is GBNF, checked against the default limits. Prints `limit` (refused by the
limits), `refused` (by the converter or llama.cpp) or `parsed`. A crash of the parser shows as
the child's death by a signal."""

from __future__ import annotations

import json
import sys
import threading

import llama_cpp
from decider.engine import chat_options
from decider.engine.bundled import smollm2_path
from decider.engine.schema_limits import GrammarLimitError, check_grammar_text
from decider.settings import GrammarLimits
from llama_cpp.llama_grammar import json_schema_to_gbnf


def main() -> int:
    mode, source, stack, text = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(smollm2_path()).encode(), params)
    vocab = llama_cpp.llama_model_get_vocab(model)
    outcome: list[str] = []

    def run() -> None:
        try:
            if mode == "schema":
                grammar = chat_options.schema_grammar(json.loads(source))
            elif mode == "raw":
                grammar = json_schema_to_gbnf(source)
            else:
                grammar = source
                check_grammar_text(grammar, GrammarLimits())
            sampler = chat_options.grammar_sampler(vocab, grammar)
        except GrammarLimitError:
            outcome.append("limit")
            return
        except chat_options.GrammarError:
            outcome.append("refused")
            return
        for byte in text.encode():  # walk the grammar: one accepted token per character
            tokens = (llama_cpp.llama_token * 8)()
            n = llama_cpp.llama_tokenize(vocab, bytes([byte]), 1, tokens, 8, False, False)
            for i in range(n):
                llama_cpp.llama_sampler_accept(sampler, tokens[i])
        llama_cpp.llama_sampler_free(sampler)
        outcome.append("parsed")

    threading.stack_size(stack)
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    print(outcome[0] if outcome else "failed", flush=True)
    return 0 if outcome else 1


if __name__ == "__main__":
    sys.exit(main())
