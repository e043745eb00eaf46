// kestrel serve as its clients see it: the real `openai` client and curl against servers this
// test starts on free loopback ports (--port 0), on the CPU engine with a small kestrel-synth
// model whose tokenizer_config.json is given a Jinja chat template. Answers are checked
// against what `kestrel generate` and `kestrel tokenize` give for the same prompt and seed.
// Run by tests/cli/serve_e2e.sh, which fetches the client; KESTREL_BIN and KESTREL_SYNTH_BIN
// name the programs.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn, execFile, execFileSync } from 'node:child_process';
import { connect } from 'node:net';
import { mkdtempSync, writeFileSync, readFileSync, rmSync, existsSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { promisify } from 'node:util';
import OpenAI from 'openai';

const kestrel = process.env.KESTREL_BIN;
const synth = process.env.KESTREL_SYNTH_BIN;
// Qwen3's tokenizer.json and tokenizer_config.json (its chat template) as Qwen ships them
// (scripts/fetch-test-tokenizers.sh), for the tools test.
const qwen3Tokenizer = process.env.KESTREL_TEST_TOKENIZERS && join(process.env.KESTREL_TEST_TOKENIZERS, 'qwen3');
const execFileP = promisify(execFile);
const KEY = 'test-key-5f2c9a';
const tmp = mkdtempSync(join(tmpdir(), 'kestrel_serve_'));
const model = join(tmp, 'tiny');
const MODEL_ID = 'tiny';
const CONTEXT = 256;

// A `kestrel serve` child: its stderr (the access log) kept, its address once listening.
class Server {
  constructor(args, dir = model) {
    this.log = '';
    const port = args.includes('--port') ? [] : ['--port', '0'];
    this.proc = spawn(kestrel, ['serve', '--device', 'cpu', '-m', dir, ...port, '-t', '1', ...args],
                      { stdio: ['ignore', 'ignore', 'pipe'] });
    this.exited = new Promise((resolve) => this.proc.on('exit', (code, signal) => resolve({ code, signal })));
    this.ready = new Promise((resolve, reject) => {
      this.proc.stderr.on('data', (d) => {
        this.log += d.toString();
        const m = this.log.match(/listening on (http:\/\/127\.0\.0\.1:\d+)/);
        if (m && !this.url) {
          this.url = m[1];
          resolve();
        }
      });
      this.exited.then(() => reject(new Error('kestrel serve exited:\n' + this.log)));
    });
    this.ready.catch(() => {});  // a server meant to fail is awaited through `exited`
  }
  client(opts = {}) {
    return new OpenAI({ baseURL: this.url + '/v1', apiKey: KEY, maxRetries: 0, ...opts });
  }
  async health() {
    return (await fetch(this.url + '/health')).json();
  }
  // Resident memory in KiB.
  rss() {
    const m = readFileSync(`/proc/${this.proc.pid}/status`, 'utf8').match(/VmRSS:\s+(\d+)/);
    return Number(m[1]);
  }
  async stop(signal = 'SIGTERM') {
    this.proc.kill(signal);
    return this.exited;
  }
}

// Polls cond (which may be async) every 10 ms until it holds; fails naming `what` after 30 s (a
// loaded machine under the sanitizers is slow, and a fixed pause would be a guess).
async function waitFor(cond, what, ms = 30000) {
  for (const t0 = Date.now(); !(await cond());) {
    assert.ok(Date.now() - t0 < ms, `waited ${ms} ms for ${what}`);
    await new Promise((r) => setTimeout(r, 10));
  }
}

// curl: status, headers and body of one request.
async function curl(url, { method = 'GET', body, key = KEY, headers = [], extra = [] } = {}) {
  const args = ['-s', '-S', '-D', '-', '-X', method, url, ...extra];
  if (key !== null) args.push('-H', `Authorization: Bearer ${key}`);
  for (const h of headers) args.push('-H', h);
  if (body !== undefined) {
    const f = join(tmp, `body_${process.hrtime.bigint()}`);
    writeFileSync(f, body);
    args.push('-H', 'Content-Type: application/json', '--data-binary', '@' + f);
  }
  const { stdout } = await execFileP('curl', args, { maxBuffer: 1 << 26 });
  const split = stdout.indexOf('\r\n\r\n');
  const head = stdout.slice(0, split);
  const status = Number(head.match(/^HTTP\/1\.1 (\d+)/)[1]);
  return { status, head, body: stdout.slice(split + 4) };
}

function kestrelJson(args) {
  return JSON.parse(execFileSync(kestrel, args, { encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] }));
}
// `kestrel generate --json`'s answer for a prompt (--chat: as a user message).
function generate(prompt, n, { chat = false, temp = 0, seed, stop, extra = [] } = {}) {
  const args = ['generate', '--device', 'cpu', '-t', '1', '-m', model, '-c', String(CONTEXT), '-p', prompt, '-n', String(n),
                '--temp', String(temp), '--json', '-q', ...extra];
  if (chat) args.push('--chat');
  if (seed !== undefined) args.push('-s', String(seed));
  if (stop !== undefined) args.push('--stop', stop);
  return kestrelJson(args);
}
function tokenizeCount(args) {
  return Number(execFileSync(kestrel, ['tokenize', '-m', model, '--count', ...args], { encoding: 'utf8' }));
}
// OpenAI's finish_reason for the engine's.
const finish = (r) => (r === 'eos' || r === 'stop' ? 'stop' : r);

function expectError(res, status, fields = {}) {
  assert.equal(res.status, status, res.head + '\n' + res.body);
  const j = JSON.parse(res.body);
  assert.deepEqual(Object.keys(j), ['error']);
  assert.deepEqual(Object.keys(j.error).sort(), ['code', 'message', 'param', 'type']);
  assert.equal(typeof j.error.message, 'string');
  for (const [k, v] of Object.entries(fields)) assert.equal(j.error[k], v, JSON.stringify(j));
  return j.error;
}

let main;   // 4 slots, a queue, an API key
let busy;   // 1 slot, a queue of 1: for 429 and cancellation

before(async () => {
  execFileSync(synth, ['--shape', 'tiny', '--layers', '2', '--dtype', 'gptq', '--bits', '4', '--group-size', '64',
                       '--seed', '11', '--quiet', '--out', model]);
  const cfgPath = join(model, 'tokenizer_config.json');
  const cfg = JSON.parse(readFileSync(cfgPath, 'utf8'));
  cfg.chat_template = "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n" +
                      "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}";
  writeFileSync(cfgPath, JSON.stringify(cfg, null, 2));
  main = new Server(['-c', String(CONTEXT), '--parallel', '4', '--queue', '16', '--api-key', KEY,
                     '--max-body', '65536']);
  busy = new Server(['-c', '2048', '--parallel', '1', '--queue', '1']);
  await Promise.all([main.ready, busy.ready]);
});

after(async () => {
  if (main && main.proc.exitCode === null) await main.stop();
  if (busy && busy.proc.exitCode === null) await busy.stop();
  rmSync(tmp, { recursive: true, force: true });
});

test('health and models', async () => {
  assert.deepEqual(await main.health(), { status: 'ok', slots_idle: 4, slots_processing: 0, queued: 0 });
  const models = await main.client().models.list();
  assert.equal(models.data.length, 1);
  assert.equal(models.data[0].id, MODEL_ID);
  assert.equal(models.data[0].object, 'model');
  assert.equal((await main.client().models.retrieve(MODEL_ID)).id, MODEL_ID);
  expectError(await curl(main.url + '/v1/models/gpt-4o'), 404, { code: 'model_not_found' });
});

test('a port in use is one line and exit code 1', async () => {
  const port = new URL(main.url).port;
  const taken = new Server(['--port', port]);
  const exit = await taken.exited;
  assert.equal(exit.code, 1);
  // Bound before the model loads: the one line is all the log holds.
  assert.equal(taken.log, `kestrel: cannot listen on 127.0.0.1:${port}: Address already in use\n`);
});

test('chat, not streamed: the text, usage and finish of kestrel generate --chat', async () => {
  const prompt = 'the river runs under a stone bridge';
  const r = await main.client().chat.completions.create({
    model: MODEL_ID, messages: [{ role: 'user', content: prompt }], max_tokens: 12, temperature: 0 });
  const g = generate(prompt, 12, { chat: true });
  assert.equal(r.object, 'chat.completion');
  assert.equal(r.model, MODEL_ID);
  assert.match(r.id, /^chatcmpl-/);
  assert.equal(r.choices.length, 1);
  assert.equal(r.choices[0].message.role, 'assistant');
  assert.equal(r.choices[0].message.content, g.text);
  assert.equal(r.choices[0].finish_reason, finish(g.finish_reason));
  const messages = join(tmp, 'messages.json');
  writeFileSync(messages, JSON.stringify([{ role: 'user', content: prompt }]));
  assert.equal(r.usage.prompt_tokens, tokenizeCount(['--messages', messages]));
  assert.equal(r.usage.prompt_tokens, g.prompt_ids.length);
  assert.equal(r.usage.completion_tokens, g.ids.length);
  assert.equal(r.usage.total_tokens, r.usage.prompt_tokens + r.usage.completion_tokens);
});

test('chat, streamed: the same text in chunks, usage last, then [DONE]', async () => {
  const messages = [{ role: 'system', content: 'Be brief.' }, { role: 'user', content: 'a kernel module loads' }];
  const whole = await main.client().chat.completions.create({ model: MODEL_ID, messages, max_tokens: 16, temperature: 0 });
  const stream = await main.client().chat.completions.create({
    model: MODEL_ID, messages, max_tokens: 16, temperature: 0, stream: true, stream_options: { include_usage: true } });
  let text = '', role, finishReason, usage, chunks = 0;
  for await (const c of stream) {
    ++chunks;
    assert.equal(c.object, 'chat.completion.chunk');
    if (c.usage) {
      usage = c.usage;
      assert.equal(c.choices.length, 0);
      continue;
    }
    const d = c.choices[0].delta;
    if (d.role) role = d.role;
    text += d.content ?? '';
    if (c.choices[0].finish_reason) finishReason = c.choices[0].finish_reason;
  }
  assert.ok(chunks >= 3);
  assert.equal(role, 'assistant');
  assert.equal(text, whole.choices[0].message.content);
  assert.equal(finishReason, whole.choices[0].finish_reason);
  assert.equal(usage.prompt_tokens, whole.usage.prompt_tokens);
  assert.equal(usage.completion_tokens, whole.usage.completion_tokens);

  // As the wire has it: server-sent events, the last one [DONE].
  const raw = await curl(main.url + '/v1/chat/completions', { method: 'POST', extra: ['-N'],
    body: JSON.stringify({ messages, max_tokens: 4, temperature: 0, stream: true }) });
  assert.equal(raw.status, 200);
  assert.match(raw.head, /content-type: text\/event-stream/i);
  const events = raw.body.split('\n\n').filter((e) => e);
  for (const e of events) assert.match(e, /^data: /);
  assert.equal(events.at(-1), 'data: [DONE]');
  assert.ok(raw.body.endsWith('data: [DONE]\n\n'));
  assert.ok(!JSON.parse(events[0].slice(6)).hasOwnProperty('usage'));  // no include_usage
});

test('completions: greedy and seeded text of kestrel generate, usage of kestrel tokenize', async () => {
  const prompt = 'python file opens with data';
  const r = await main.client().completions.create({ model: MODEL_ID, prompt, max_tokens: 10, temperature: 0 });
  const g = generate(prompt, 10);
  assert.equal(r.object, 'text_completion');
  assert.equal(r.choices[0].text, g.text);
  assert.equal(r.choices[0].finish_reason, finish(g.finish_reason));
  assert.equal(r.usage.prompt_tokens, tokenizeCount(['-p', prompt]));
  assert.equal(r.usage.completion_tokens, g.ids.length);

  const s = await main.client().completions.create({ model: MODEL_ID, prompt, max_tokens: 10, temperature: 0.9, seed: 123 });
  assert.equal(s.choices[0].text, generate(prompt, 10, { temp: 0.9, seed: 123 }).text);

  // Streamed completions, and token ids as the prompt.
  const stream = await main.client().completions.create({ model: MODEL_ID, prompt, max_tokens: 10, temperature: 0, stream: true });
  let text = '';
  for await (const c of stream) text += c.choices[0]?.text ?? '';
  assert.equal(text, g.text);
  const ids = await main.client().completions.create({ model: MODEL_ID, prompt: g.prompt_ids, max_tokens: 10, temperature: 0 });
  assert.equal(ids.choices[0].text, g.text);
});

test('stop strings end the text before them', async () => {
  const prompt = 'the user asks for';
  const full = generate(prompt, 24).text;
  const at = full.search(/\S\S/, 4);
  assert.ok(at >= 0, 'the greedy text has no two letters in a row: ' + JSON.stringify(full));
  const stop = full.slice(at, at + 2);
  const cut = full.indexOf(stop);
  for (const s of [stop, [stop, 'never-seen']]) {
    const r = await main.client().completions.create({ model: MODEL_ID, prompt, max_tokens: 24, temperature: 0, stop: s });
    assert.equal(r.choices[0].text, full.slice(0, cut));
    assert.equal(r.choices[0].finish_reason, 'stop');
  }
  assert.equal(generate(prompt, 24, { stop }).text, full.slice(0, cut));
});

test('logprobs: one per token, the chosen one the most likely when greedy', async () => {
  const prompt = 'when the bridge';
  const r = await main.client().chat.completions.create({
    model: MODEL_ID, messages: [{ role: 'user', content: prompt }], max_tokens: 6, temperature: 0, logprobs: true, top_logprobs: 3 });
  const content = r.choices[0].logprobs.content;
  assert.equal(content.length, r.usage.completion_tokens);
  const g = kestrelJson(['generate', '--device', 'cpu', '-t', '1', '-m', model, '-c', String(CONTEXT), '-p', prompt, '--chat',
                         '-n', '6', '--temp', '0', '--json', '--logprobs', '3', '-q']);
  for (let i = 0; i < content.length; ++i) {
    const t = content[i];
    assert.equal(t.top_logprobs.length, 3);
    assert.ok(t.logprob <= 0);
    assert.equal(t.top_logprobs[0].logprob, t.logprob);
    assert.equal(t.top_logprobs[0].token, t.token);
    assert.ok(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob);
    assert.ok(Array.isArray(t.bytes));
    assert.ok(Math.abs(t.logprob - g.logprobs[i].logprob) < 1e-4);
  }
  if (r.choices[0].finish_reason === 'length')
    assert.equal(content.map((t) => t.token).join(''), r.choices[0].message.content);

  const c = await main.client().completions.create({ model: MODEL_ID, prompt, max_tokens: 5, temperature: 0, logprobs: 2 });
  const lp = c.choices[0].logprobs;
  assert.equal(lp.tokens.length, c.usage.completion_tokens);
  assert.equal(lp.token_logprobs.length, lp.tokens.length);
  assert.equal(Object.keys(lp.top_logprobs[0]).length <= 2, true);
});

test('errors: OpenAI error objects, and the server keeps serving', async () => {
  const url = main.url + '/v1/chat/completions';
  const msgs = [{ role: 'user', content: 'hi' }];
  expectError(await curl(url, { method: 'POST', body: '{"messages": [' }), 400, { code: 'invalid_json', type: 'invalid_request_error' });
  expectError(await curl(url, { method: 'POST', body: JSON.stringify({ messages: msgs, temperature: 'hot' }) }), 400, { param: 'temperature' });
  expectError(await curl(url, { method: 'POST', body: JSON.stringify({ messages: 'hi' }) }), 400, { param: 'messages' });
  expectError(await curl(url, { method: 'POST', body: JSON.stringify({ messages: msgs, max_tokens: '5' }) }), 400, { param: 'max_tokens' });
  expectError(await curl(url, { method: 'POST', body: JSON.stringify({ messages: msgs, n: 2 }) }), 400, { param: 'n' });
  expectError(await curl(url, { method: 'POST', body: JSON.stringify({ messages: msgs, model: 'gpt-4o' }) }), 404, { code: 'model_not_found' });
  const long = 'the river runs under a stone bridge and '.repeat(40);
  expectError(await curl(url, { method: 'POST', body: JSON.stringify({ messages: [{ role: 'user', content: long }], max_tokens: 4 }) }),
              400, { code: 'context_length_exceeded', param: 'messages' });
  expectError(await curl(main.url + '/v1/completions', { method: 'POST', body: JSON.stringify({ prompt: 'a', max_tokens: CONTEXT }) }),
              400, { code: 'context_length_exceeded', param: 'prompt' });
  expectError(await curl(main.url + '/v1/nothing-here'), 404);
  // A path of the API asked with the other method: 405 and Allow, as vLLM answers.
  const get = await curl(main.url + '/v1/completions');
  expectError(get, 405, { code: 'method_not_allowed' });
  assert.match(get.head, /\r\nAllow: POST\r\n/i);
  assert.match((await curl(main.url + '/v1/models', { method: 'POST', body: '{}' })).head, /\r\nAllow: GET, HEAD\r\n/i);
  expectError(await curl(main.url + '/health', { method: 'POST', body: '{}', key: null }), 405);
  // A POST without its length: 411 at once, not after the server's read timeout.
  const t0 = Date.now();
  expectError(await curl(url, { method: 'POST' }), 411, { code: 'length_required' });
  assert.ok(Date.now() - t0 < 5000, `411 after ${Date.now() - t0} ms`);
  // Over --max-body: 413, in the same shape.
  expectError(await curl(url, { method: 'POST', body: JSON.stringify({ messages: [{ role: 'user', content: 'x'.repeat(100000) }] }) }), 413);
  // The client raises them as its own errors.
  await assert.rejects(main.client().chat.completions.create({ model: MODEL_ID, messages: msgs, n: 2 }),
                       (e) => e instanceof OpenAI.BadRequestError && e.status === 400 && e.param === 'n');
  const ok = await main.client().chat.completions.create({ model: MODEL_ID, messages: msgs, max_tokens: 2 });
  assert.equal(ok.choices.length, 1);
});

test('auth: a key is needed everywhere but /health', async () => {
  const body = JSON.stringify({ messages: [{ role: 'user', content: 'hi' }], max_tokens: 1 });
  const url = main.url + '/v1/chat/completions';
  expectError(await curl(url, { method: 'POST', body, key: null }), 401, { type: 'authentication_error' });
  expectError(await curl(url, { method: 'POST', body, key: 'wrong' }), 401);
  expectError(await curl(main.url + '/v1/models', { key: KEY + 'x' }), 401);
  expectError(await curl(main.url + '/tokenize', { method: 'POST', body: '{"content": "a"}', key: null }), 401);
  assert.equal((await curl(main.url + '/health', { key: null })).status, 200);
  await assert.rejects(main.client({ apiKey: 'nope' }).models.list(), (e) => e instanceof OpenAI.AuthenticationError);
  assert.equal((await curl(url, { method: 'POST', body })).status, 200);
});

test('tokenize and detokenize as llama-server has them', async () => {
  const content = 'the kernel module loads';
  const t = await curl(main.url + '/tokenize', { method: 'POST', body: JSON.stringify({ content, add_special: true }) });
  assert.equal(t.status, 200);
  const ids = JSON.parse(t.body).tokens;
  const k = kestrelJson(['tokenize', '-m', model, '-p', content, '--json']);
  assert.deepEqual(ids, k.ids);
  const plain = JSON.parse((await curl(main.url + '/tokenize', { method: 'POST', body: JSON.stringify({ content }) })).body).tokens;
  assert.deepEqual(plain, k.ids.slice(1));  // no BOS unless add_special
  const pieces = JSON.parse((await curl(main.url + '/tokenize', { method: 'POST',
    body: JSON.stringify({ content, with_pieces: true }) })).body).tokens;
  assert.deepEqual(pieces.map((p) => p.id), plain);
  assert.equal(pieces.map((p) => p.piece).join('').trim(), content);
  const d = await curl(main.url + '/detokenize', { method: 'POST', body: JSON.stringify({ tokens: ids }) });
  assert.equal(JSON.parse(d.body).content, content);
  expectError(await curl(main.url + '/detokenize', { method: 'POST', body: '{"tokens": [999999]}' }), 400, { param: 'tokens' });
});

test('the access log: one line per request, never the key or the prompt', async () => {
  const secret = 'a very particular prompt';
  const before = main.log.split('\n').filter((l) => l.includes('POST /v1/completions 200')).length;
  await main.client().completions.create({ model: MODEL_ID, prompt: secret, max_tokens: 3, temperature: 0 });
  // The line is written once the answer is: the client may read it a moment before.
  await waitFor(() => main.log.split('\n').filter((l) => l.includes('POST /v1/completions 200')).length > before,
                'the access log line of the request');
  const line = main.log.split('\n').filter((l) => l.includes('POST /v1/completions 200')).at(-1);
  assert.match(line, /POST \/v1\/completions 200 prompt=\d+ completion=3 finish=length [\d.]+ ms$/);
  assert.ok(!main.log.includes(KEY));
  assert.ok(!main.log.includes(secret));
  assert.match(main.log, /POST \/v1\/chat\/completions 400 .*ms/);
  assert.match(main.log, /POST \/v1\/chat\/completions 401 .*ms/);
  assert.match(main.log, /POST \/v1\/chat\/completions 413 .*ms/);
});

test('a full queue answers 429; a client that goes away frees its slot at once', async () => {
  const client = busy.client({ apiKey: 'unused' });
  // A: a long stream that holds the one slot.
  const controller = new AbortController();
  const a = await client.completions.create({ prompt: 'the river', max_tokens: 2000, temperature: 0, stream: true },
                                             { signal: controller.signal });
  const it = a[Symbol.asyncIterator]();
  await it.next();
  // B waits in the queue of one; C finds it full.
  const b = client.completions.create({ prompt: 'a stone bridge', max_tokens: 4, temperature: 0 });
  for (let i = 0; (await busy.health()).queued < 1; ++i) {
    assert.ok(i < 500, 'B never queued');
    await new Promise((r) => setTimeout(r, 10));
  }
  const c = await curl(busy.url + '/v1/completions', { method: 'POST', key: null, body: JSON.stringify({ prompt: 'x', max_tokens: 1 }) });
  expectError(c, 429, { code: 'rate_limit_exceeded', type: 'rate_limit_error' });
  assert.match(c.head, /retry-after: 1/i);
  await assert.rejects(client.completions.create({ prompt: 'x', max_tokens: 1 }), (e) => e instanceof OpenAI.RateLimitError);

  // A goes away: its generation stops within a few tokens, and B runs.
  controller.abort();
  const started = Date.now();
  const rb = await b;
  assert.equal(rb.choices[0].text, generate('a stone bridge', 4).text);
  await waitFor(() => busy.log.includes('finish=cancelled'), 'the cancelled request in the log:\n' + busy.log);
  const lineA = busy.log.split('\n').find((l) => l.includes('finish=cancelled'));
  assert.ok(lineA, busy.log);
  assert.ok(Number(lineA.match(/completion=(\d+)/)[1]) < 2000, lineA);
  assert.ok(Date.now() - started < 10000);

  // A non-streamed request whose client gives up is cancelled too.
  await assert.rejects(execFileP('curl', ['-s', '--max-time', '0.3', '-X', 'POST', busy.url + '/v1/completions', '-d',
                                          JSON.stringify({ prompt: 'the river', max_tokens: 2000, temperature: 0 })]));
  await waitFor(() => /POST \/v1\/completions 499 .*finish=cancelled/.test(busy.log),
                'the abandoned request was not cancelled:\n' + busy.log);
  let health;
  await waitFor(async () => (health = await busy.health()).slots_idle === 1, 'the slot freed');
  assert.deepEqual(health, { status: 'ok', slots_idle: 1, slots_processing: 0, queued: 0 });
});

// One connection, as a client that pools connections keeps it: each request written when
// the previous answer has been read whole, resolved with that answer's head ('' when the
// server closed the connection first).
function keptAlive(url) {
  const { hostname, port } = new URL(url);
  const sock = connect(Number(port), hostname);
  let buf = '', waiting = null, closed = false;
  const settle = () => {
    if (!waiting) return;
    const end = buf.indexOf('\r\n\r\n');
    if (end < 0) return;
    const head = buf.slice(0, end);
    const length = head.match(/content-length: (\d+)/i);
    const done = length ? buf.length >= end + 4 + Number(length[1]) : buf.endsWith('\r\n0\r\n\r\n');
    if (!done) return;
    buf = '';
    const w = waiting;
    waiting = null;
    w(head);
  };
  sock.setEncoding('latin1');
  sock.on('data', (d) => { buf += d; settle(); });
  const gone = () => {
    closed = true;
    if (waiting) { const w = waiting; waiting = null; w(''); }
  };
  for (const e of ['end', 'close', 'error']) sock.on(e, gone);
  return {
    request(path, body) {
      return new Promise((resolve) => {
        if (closed) return resolve('');
        waiting = resolve;
        sock.write(`POST ${path} HTTP/1.1\r\nHost: ${hostname}\r\nAuthorization: Bearer ${KEY}\r\n` +
                   `Content-Type: application/json\r\nContent-Length: ${Buffer.byteLength(body)}\r\n\r\n${body}`);
      });
    },
    close() { sock.destroy(); },
  };
}

test('a kept-alive connection idle past the Keep-Alive hint still answers its next request', async () => {
  // The server closes idle connections well after the hint it gives: a client that reuses one
  // later than the hint (its own pool's expiry, or its clock stalled) must not find it closed
  // under the request it has written (docs/hardening.md).
  const c = keptAlive(main.url);
  try {
    const first = await c.request('/v1/completions', JSON.stringify({ prompt: 'the river', max_tokens: 3, stream: true }));
    assert.match(first, /^HTTP\/1\.1 200/);
    assert.match(first, /transfer-encoding: chunked/i);
    const hint = Number(first.match(/keep-alive: timeout=(\d+)/i)?.[1]);
    assert.ok(hint >= 1, first);
    await new Promise((r) => setTimeout(r, hint * 1000 + 1000));
    const next = await c.request('/v1/completions', JSON.stringify({ prompt: 'the river', max_tokens: 2 }));
    assert.match(next, /^HTTP\/1\.1 200/, 'the server closed the connection under the next request');
  } finally {
    c.close();
  }
});

test('load: 32 concurrent streaming clients, each text that of kestrel generate', async () => {
  const prompts = ['the river', 'a stone bridge and', 'kernel module loads when', 'the user asks for python',
                   'file opens with data', 'under a bridge the'];
  const cases = [];
  for (const p of prompts) {
    cases.push({ prompt: p, temperature: 0 });
    cases.push({ prompt: p, temperature: 0.8, seed: cases.length * 7 + 1 });
  }
  // The expected texts from one kestrel generate --batch-file run.
  const batch = join(tmp, 'batch.jsonl');
  writeFileSync(batch, cases.map((c) => JSON.stringify({ prompt: c.prompt, n_predict: 16, temperature: c.temperature,
                                                         ...(c.seed !== undefined ? { seed: c.seed } : {}) })).join('\n') + '\n');
  const expected = execFileSync(kestrel, ['generate', '--device', 'cpu', '-t', '1', '-m', model, '-c', String(CONTEXT), '--batch-file', batch, '-q'],
                                { encoding: 'utf8' }).trim().split('\n').map((l) => JSON.parse(l).text);

  const client = main.client();
  let refused = 0;
  // One request, asked again after Retry-After each time it is answered 429.
  const run = async (i) => {
    const c = cases[i % cases.length];
    for (;;) {
      try {
        const stream = await client.completions.create({ model: MODEL_ID, prompt: c.prompt, max_tokens: 16,
                                                         temperature: c.temperature, seed: c.seed, stream: true });
        let text = '';
        for await (const ch of stream) text += ch.choices[0]?.text ?? '';
        assert.equal(text, expected[i % cases.length], `request ${i}: ${JSON.stringify(c)}`);
        return;
      } catch (e) {
        if (!(e instanceof OpenAI.RateLimitError)) throw e;
        assert.equal(e.headers.get('retry-after'), '1');
        ++refused;
        await new Promise((r) => setTimeout(r, 200));  // sooner than asked, to keep the test short
      }
    }
  };
  const wave = async (n, clients) => {
    let next = 0;
    await Promise.all(Array.from({ length: clients }, async () => {
      while (next < n) await run(next++);
    }));
  };
  await wave(32, 32);  // warm: every slot, thread and buffer the load needs
  const rss0 = main.rss();
  refused = 0;
  // Under AddressSanitizer (scripts/sanitize.sh) freed memory sits in quarantine: RSS says
  // nothing there, and LeakSanitizer checks the server's memory instead; the second wave is
  // then as long as it takes to run the same code, not to watch the memory.
  const sanitized = Boolean(process.env.ASAN_OPTIONS);
  const n = sanitized ? 64 : 224;
  await wave(n, 32);
  const rss1 = main.rss();
  console.log(`# load: ${n} requests completed, ${refused} answers of 429 on the way; RSS ${rss0} -> ${rss1} KiB`);
  if (!sanitized)
    assert.ok(rss1 - rss0 < 16 * 1024, `RSS grew from ${rss0} to ${rss1} KiB`);
  // A slot frees once its answer is written, which the client may see a moment before.
  let health;
  await waitFor(async () => (health = await main.health()).slots_idle === 4, 'every slot idle');
  assert.deepEqual(health, { status: 'ok', slots_idle: 4, slots_processing: 0, queued: 0 });
});

test('--spec: the text of kestrel generate --spec, concurrent slots, drafts counted in usage', async () => {
  // A draft model the size of the target (the model itself): every greedy draft is kept.
  const draftArgs = ['--spec', 'draft', '--draft-model', model, '--draft-max', '4'];
  const draft = new Server(['-c', String(CONTEXT), '--parallel', '2', ...draftArgs]);
  const lookup = new Server(['-c', String(CONTEXT), '--parallel', '2', '--spec', 'lookup']);
  try {
    await Promise.all([draft.ready, lookup.ready]);
    assert.match(draft.log, /speculative draft \(draft-max 4\)/);
    const prompt = 'the river runs past the mill, the river runs past the mill, the river';
    const plain = generate(prompt, 16);
    for (const srv of [draft, lookup]) {
      // Two greedy requests at once, one streamed, on the two slots: each the plain text.
      const [r, stream] = await Promise.all([
        srv.client().completions.create({ model: MODEL_ID, prompt, max_tokens: 16, temperature: 0 }),
        srv.client().completions.create({ model: MODEL_ID, prompt, max_tokens: 16, temperature: 0, stream: true }),
      ]);
      let text = '';
      for await (const c of stream) text += c.choices[0]?.text ?? '';
      assert.equal(r.choices[0].text, plain.text);
      assert.equal(text, plain.text);
      const d = r.usage.completion_tokens_details;
      assert.ok(d.accepted_prediction_tokens + d.rejected_prediction_tokens > 0, JSON.stringify(r.usage));
      if (srv === draft) assert.equal(d.rejected_prediction_tokens, 0, JSON.stringify(r.usage));
      // One token needs no draft; the counts are there, zero.
      const one = await srv.client().completions.create({ model: MODEL_ID, prompt, max_tokens: 1, temperature: 0 });
      assert.deepEqual(one.usage.completion_tokens_details,
                       { accepted_prediction_tokens: 0, rejected_prediction_tokens: 0 });
    }
    // Sampled: speculation draws its own random numbers, so the seeded text is that of
    // kestrel generate with the same --spec.
    const s = await draft.client().completions.create({ model: MODEL_ID, prompt, max_tokens: 16, temperature: 0.9, seed: 77 });
    assert.equal(s.choices[0].text, generate(prompt, 16, { temp: 0.9, seed: 77, extra: draftArgs }).text);
  } finally {
    await Promise.all([draft.stop(), lookup.stop()]);
  }
  // --draft-max without --spec is refused, as in generate.
  const bad = new Server(['--draft-max', '4']);
  const { code } = await bad.exited;
  assert.equal(code, 1);
  assert.match(bad.log, /--draft-max goes with --spec/);
});

// OpenAI's tools API with the official client, on a tiny random model with Qwen3's real
// tokenizer and chat template (Hermes <tool_call> calls). A random model calls no tool of its
// own accord, so the calls are required (tool_choice "required" or a named function): the
// grammar built from the tools' schemas makes the reply a call that parses, and greedy
// decoding makes it the same call streamed or not. Enums and bounded integers keep it short.
test('tools: required and named calls, streamed and not, and the tool result sent back', async () => {
  assert.ok(qwen3Tokenizer && existsSync(join(qwen3Tokenizer, 'tokenizer.json')),
            'Qwen3 tokenizer missing: run scripts/fetch-test-tokenizers.sh into KESTREL_TEST_TOKENIZERS');
  const qwen = join(tmp, 'qwen3-tiny');
  execFileSync(synth, ['--shape', 'tiny', '--layers', '1', '--seed', '6', '--quiet', '--tokenizer', qwen3Tokenizer,
                       '--out', qwen]);
  const srv = new Server(['-c', '2048', '--parallel', '2', '--chat-template-kwargs', '{"enable_thinking": false}'], qwen);
  await srv.ready;
  try {
    const client = srv.client({ apiKey: 'unused' });
    const tools = [
      { type: 'function', function: {
        name: 'get_weather', description: 'The weather in a city',
        parameters: { type: 'object',
                      properties: { city: { type: 'string', enum: ['Paris', 'Tokyo'] },
                                    unit: { type: 'string', enum: ['celsius', 'fahrenheit'] },
                                    days: { type: 'integer', minimum: 1, maximum: 7 } },
                      required: ['city', 'unit', 'days'] } } },
      { type: 'function', function: {
        name: 'get_time', description: 'The time in a zone',
        parameters: { type: 'object', properties: { zone: { enum: ['UTC', 'CET'] } }, required: ['zone'] } } },
    ];
    const messages = [{ role: 'user', content: 'What is the weather in Paris?' }];
    const checkArgs = (call) => {
      const args = JSON.parse(call.function.arguments);
      if (call.function.name === 'get_weather') {
        assert.deepEqual(Object.keys(args), ['city', 'unit', 'days'], call.function.arguments);
        assert.ok(['Paris', 'Tokyo'].includes(args.city) && ['celsius', 'fahrenheit'].includes(args.unit));
        assert.ok(Number.isInteger(args.days) && args.days >= 1 && args.days <= 7, call.function.arguments);
      } else {
        assert.equal(call.function.name, 'get_time');
        assert.ok(['UTC', 'CET'].includes(args.zone), call.function.arguments);
      }
      return args;
    };

    for (const [tool_choice, extra] of [['required', { parallel_tool_calls: false }],
                                        [{ type: 'function', function: { name: 'get_time' } }, {}]]) {
      const body = { model: 'qwen3-tiny', messages, tools, tool_choice, max_tokens: 120, temperature: 0, ...extra };
      // Not streamed.
      const r = await client.chat.completions.create(body);
      const choice = r.choices[0];
      assert.equal(choice.finish_reason, 'tool_calls', JSON.stringify(r));
      assert.equal(choice.message.role, 'assistant');
      assert.equal(choice.message.content, null);
      assert.equal(choice.message.tool_calls.length, 1, JSON.stringify(r));
      const call = choice.message.tool_calls[0];
      assert.equal(call.type, 'function');
      assert.match(call.id, /^call_[A-Za-z0-9]{24}$/);
      if (typeof tool_choice === 'object') assert.equal(call.function.name, 'get_time');
      checkArgs(call);

      // Streamed, raw chunks: the call opened with its index, id, type, name and empty
      // arguments, then argument fragments; finish_reason last.
      const raw = await client.chat.completions.create({ ...body, stream: true });
      const pieces = [];
      let finish = null;
      for await (const chunk of raw) {
        const c = chunk.choices[0];
        if (!c) continue;
        if (c.delta?.tool_calls) pieces.push(...c.delta.tool_calls);
        if (c.finish_reason) finish = c.finish_reason;
        assert.ok(!c.delta?.content, 'no text beside a required call: ' + JSON.stringify(chunk));
      }
      assert.equal(finish, 'tool_calls');
      assert.ok(pieces.length >= 2, JSON.stringify(pieces));
      assert.equal(pieces[0].index, 0);
      assert.equal(pieces[0].type, 'function');
      assert.equal(pieces[0].function.name, call.function.name);
      assert.equal(pieces[0].function.arguments, '');
      assert.match(pieces[0].id, /^call_[A-Za-z0-9]{24}$/);
      for (const p of pieces.slice(1)) {
        assert.equal(p.index, 0);
        assert.equal(p.id, undefined);
        assert.equal(typeof p.function.arguments, 'string');
      }
      assert.equal(pieces.map((p) => p.function.arguments).join(''), call.function.arguments);

      // Streamed, assembled by the client's own stream helper: the same call.
      const stream = client.chat.completions.stream(body);
      const final = await stream.finalChatCompletion();
      const fc = final.choices[0];
      assert.equal(fc.finish_reason, 'tool_calls');
      assert.equal(fc.message.tool_calls.length, 1);
      assert.equal(fc.message.tool_calls[0].function.name, call.function.name);
      assert.equal(fc.message.tool_calls[0].function.arguments, call.function.arguments);
      assert.equal(fc.message.tool_calls[0].type, 'function');
      checkArgs(fc.message.tool_calls[0]);

      // The result sent back: the assistant's message as the client got it, and a tool
      // message answering its call. The history is rendered (more prompt tokens) and answered.
      const followUp = await client.chat.completions.create({
        model: 'qwen3-tiny', tools, max_tokens: 6, temperature: 0,
        messages: [...messages, choice.message,
                   { role: 'tool', tool_call_id: call.id, content: JSON.stringify({ temperature: 21 }) }],
      });
      assert.ok(['stop', 'length', 'tool_calls'].includes(followUp.choices[0].finish_reason));
      assert.ok(followUp.usage.prompt_tokens > r.usage.prompt_tokens + 10, JSON.stringify([followUp.usage, r.usage]));
    }

    // auto: the model may answer in text; whatever it writes, the answer is well formed.
    const auto = await client.chat.completions.create({ model: 'qwen3-tiny', messages, tools, max_tokens: 8 });
    assert.ok(['stop', 'length', 'tool_calls'].includes(auto.choices[0].finish_reason));

    // Malformed tools: one 400 naming the field.
    const post = (b) => curl(srv.url + '/v1/chat/completions', { method: 'POST', key: null, body: JSON.stringify(b) });
    expectError(await post({ messages, tools: { type: 'function' } }), 400, { param: 'tools' });
    expectError(await post({ messages, tools: [{ type: 'function', function: { description: 'no name' } }] }), 400,
                { param: 'tools[0].function.name' });
    const e = expectError(await post({ messages, tools: [{ type: 'function', function: { name: 'f', parameters:
      { type: 'object', properties: { a: { not: {} } } } } }] }), 400, { param: 'tools[0].function.parameters' });
    assert.match(e.message, /unsupported keyword 'not'/);
    expectError(await post({ messages, tools, tool_choice: { type: 'function', function: { name: 'nope' } } }), 400,
                { param: 'tool_choice' });
    // The server lives on.
    assert.equal((await srv.health()).status, 'ok');
  } finally {
    await srv.stop();
  }
  // A template with no tool syntax (main's): 400 naming that.
  const e = expectError(await curl(main.url + '/v1/chat/completions', { method: 'POST', body: JSON.stringify({
    messages: [{ role: 'user', content: 'Hi' }], tools: [{ type: 'function', function: { name: 'f' } }] }) }),
    400, { param: 'tools', code: 'tools_unsupported' });
  assert.match(e.message, /no tool-call syntax/);
});

test('SIGINT and SIGTERM: in-flight requests end, the server exits 0', async () => {
  const client = busy.client({ apiKey: 'unused' });
  const s = await client.completions.create({ prompt: 'the river', max_tokens: 2000, temperature: 0, stream: true });
  const it = s[Symbol.asyncIterator]();
  await it.next();
  const exited = busy.stop('SIGINT');
  await assert.rejects((async () => { for (;;) if ((await it.next()).done) throw new Error('the stream ended as if complete'); })(),
                       (e) => !/ended as if complete/.test(e.message));
  assert.deepEqual(await exited, { code: 0, signal: null });
  assert.match(busy.log, /SIGINT: stopping/);
  assert.deepEqual(await main.stop('SIGTERM'), { code: 0, signal: null });
  assert.match(main.log, /kestrel: stopped/);
});
