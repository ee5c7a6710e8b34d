"""Structured output through xgrammar: each constraint checked and compiled under limits before its
request is admitted, then a per-row token bitmask applied to the logits of a mixed batch before
sampling.

    specs.py     what a spec may be, told before compiling (size, keywords xgrammar would not
                 enforce), the xgrammar Grammar of a spec, the errors
    language.py  whether a grammar's language is empty (no text satisfies it)
    worker.py    the compile worker process (a child process: service.engine.child) and its handle
    cache.py     the compiled grammars kept, by spec, under a byte budget
    compiler.py  GrammarCompiler: compile jobs, one thread per worker, the cache, the bitmasks
    row.py       GuidedRow: one request's place in its grammar, and the reasoning-first states

Only compiler.py and row.py need torch; this package's __init__ imports nothing, so a compile
worker reads its vocabulary before any heavy import.

Compiling a request's GuidedDecoding (`GrammarCompiler.prepare`, awaited by the engine's check,
or `GrammarCompiler.submit` where no event loop runs):

1. Refused at once when larger than NIM_MAX_GUIDED_SPEC_BYTES, and a JSON schema when it uses a
   keyword xgrammar would accept and silently not enforce (`unenforced_keyword`: `not`, `if`,
   `contains`, `uniqueItems`, an assertion beside `$ref` / `const` / `enum` / `anyOf` / `allOf`, a
   string or number bound on a schema without a type, ...).
2. A compile job is queued: NIM_GUIDED_COMPILE_WORKERS compiles run at once (one thread per worker
   process), the rest wait in arrival order, and a wait ends when the request is cancelled (its
   client left).
3. A worker process checks it under NIM_GUIDED_COMPILE_TIMEOUT_SECONDS: the spec becomes a grammar,
   which is refused when xgrammar warns that it ignores part of it (allOf of several schemas,
   multipleOf on numbers, a lookahead in a pattern, ...) or when its language is empty (no text
   satisfies it: `root ::= root`, a `$ref` cycle, a pattern matching nothing; `empty_language`),
   and is then compiled. A worker past the limit, or whose request was cancelled, is killed
   (SIGKILL) and reaped, and a replacement is started.
4. Only then does this process compile the same grammar, on the job's thread.
5. The result is cached by spec, bounded by NIM_GUIDED_CACHE_BYTES (xgrammar's own estimate of a
   compiled grammar's memory, least recently used out); an entry stays while a request that was
   checked with it lives, so the step thread finds it. Refusals are cached too (by count).

Why a process, and why compile twice. xgrammar compiles in C++, releasing the GIL but never
returning early, so a thread can be neither stopped nor timed out: only a process can be. Its
CompiledGrammar serializes (serialize_json) and reads back with the tokenizer info, but the text
grows out of all proportion for objects with optional properties. Measured with xgrammar 0.2.8 and
this model's 49,152-token vocabulary, one core:

    spec                          compile   memory    serialized   write    read back
    5,000 choices                  0.04 s   0.36 MB      0.35 MB   0.01 s     0.003 s
    200 optional properties        0.04 s    1.5 MB        25 MB    2.2 s      0.36 s
    1,000 optional properties       1.0 s    7.6 MB       637 MB     45 s       10 s
    2,000 optional properties      16.4 s   (57 KB of schema; 20,000 were still going at 14 min)

So the worker answers only "compiles within the limit, and how long it took"; the second compile
here then costs what the first did (milliseconds for ordinary schemas, at most about the limit),
on a thread that releases the GIL (the event loop went at most 21 ms without running during a
1.5 s compile). A worker starts in about 2.5 s (importing xgrammar imports torch), on the first
constrained request; the server's own start-up is unchanged. Workers exit when the server does
(they watch their parent), and are killed when the compiler is collected or the process exits.
xgrammar's memory estimate follows the process's resident memory within ~1.5x (measured: 10
300-property objects, 23.9 MB estimated, 27.2 MB resident; 200 small schemas with maxLength,
375 MB estimated, 351 MB resident), so the cache is bounded by its sum.

Token text for xgrammar is each token's raw bytes (Tokenizer.token_bytes); special tokens other
than the end-of-sequence ones are given no text, so a grammar never lets them through. The runner
keeps one GrammarMatcher per constrained request for as long as it lives (preemption keeps it:
recomputed tokens are not sampled again). Each step, before sampling, the constrained rows' allowed
tokens are written into one bitmask and applied in place (disallowed logits become -inf); after
sampling each matcher accepts its row's token. The end-of-sequence tokens are allowed exactly when
the grammar is complete, so a constrained answer ends with one (unless max_tokens cuts it short,
which OpenAI reports as finish_reason "length"). A constraint with `start_after` (a reasoning
model's `</think>`) leaves its row unmasked, and its matcher untouched, until those tokens have been
generated: the thinking is free, the answer after it is constrained. Where the prompt left it open
whether the model thinks (`opens_with`: its `<think>`), the first token decides: the thinking's
opening, or the grammar's first token, constrained from there (GuidedRow).
"""
