#!/usr/bin/env node
// Renders the real chat templates in tests/data/chat_templates/ over a set of conversations with
// @huggingface/jinja (transformers.js's renderer, an implementation independent of Kestrel's) and
// writes what it renders to tests/data/chat_templates/goldens.json. tests/unit/test_jinja.cpp
// renders the same cases with Kestrel's interpreter and compares byte for byte.
//
//   node scripts/make-jinja-goldens.mjs        # installs @huggingface/jinja into $TMPDIR once
//
// Each case records the whole render context (messages, add_generation_prompt, the model's
// bos/eos tokens, tools, ...), so the C++ test needs nothing but the file. strftime_now is fixed
// to FIXED_DATE in both renderers, so that the goldens do not change with the day.
import { execFileSync } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";

const HF_JINJA_VERSION = "0.5.11";
const FIXED_DATE = { year: 2025, month: 3, day: 14, hour: 9, minute: 26 }; // 14 Mar 2025 09:26

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..");
const dataDir = path.join(root, "tests", "data", "chat_templates");

// ---- @huggingface/jinja, installed outside the repository ----

const prefix = path.join(os.tmpdir(), `kestrel-hf-jinja-${HF_JINJA_VERSION}`);
const moduleDir = path.join(prefix, "node_modules", "@huggingface", "jinja");
if (!fs.existsSync(path.join(moduleDir, "package.json"))) {
  fs.mkdirSync(prefix, { recursive: true });
  execFileSync("npm", ["install", "--prefix", prefix, "--no-save", "--no-audit", "--no-fund",
                       `@huggingface/jinja@${HF_JINJA_VERSION}`], { stdio: "inherit" });
}
const { Template, Environment, Interpreter } = await import(
  pathToFileURL(path.join(moduleDir, "dist", "index.js")).href);

// ---- the renderer ----

const MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
                "September", "October", "November", "December"];
const pad2 = (n) => String(n).padStart(2, "0");

// Python's strftime for the fixed date, in the C locale (the directives chat templates use).
function strftime(format) {
  const d = FIXED_DATE;
  return format.replace(/%./g, (token) => {
    switch (token) {
      case "%Y": return String(d.year);
      case "%m": return pad2(d.month);
      case "%d": return pad2(d.day);
      case "%b": return MONTHS[d.month - 1].slice(0, 3);
      case "%B": return MONTHS[d.month - 1];
      case "%H": return pad2(d.hour);
      case "%M": return pad2(d.minute);
      case "%%": return "%";
      default: throw new Error(`strftime: unsupported directive ${token}`);
    }
  });
}

class Raised extends Error {}

function range(start, stop, step = 1) {
  if (stop === undefined) [start, stop] = [0, start];
  const out = [];
  for (let i = start; step > 0 ? i < stop : i > stop; i += step) out.push(i);
  return out;
}

// Template.render() with strftime_now fixed: the globals of @huggingface/jinja's setupGlobals(),
// which has no way to replace one of them.
function render(source, context) {
  const template = new Template(source);
  const env = new Environment();
  for (const [name, value] of [["false", false], ["true", true], ["none", null],
                               ["False", false], ["True", true], ["None", null]]) {
    env.set(name, value);
  }
  env.set("raise_exception", (message) => { throw new Raised(message); });
  env.set("range", range);
  env.set("strftime_now", strftime);
  for (const [key, value] of Object.entries(context)) env.set(key, value);
  return new Interpreter(env).run(template.parsed).value;
}

// ---- the templates and the models' special tokens ----

const LLAMA3 = { bos_token: "<|begin_of_text|>", eos_token: "<|eot_id|>" };
const SENTENCEPIECE = { bos_token: "<s>", eos_token: "</s>" };
const QWEN = { eos_token: "<|im_end|>" }; // Qwen has no BOS token
const GEMMA = { bos_token: "<bos>", eos_token: "<eos>" };

// tools: the template takes an OpenAI-style tool list and tool-call messages.
// hfSource: what @huggingface/jinja is given instead of the file, where it cannot read it.
const TEMPLATES = {
  "llama3.jinja": { tokens: LLAMA3 },
  "llama3.1.jinja": { tokens: LLAMA3, tools: true },
  "llama3.2.jinja": { tokens: LLAMA3, tools: true, dates: true },
  "llama2.jinja": { tokens: SENTENCEPIECE },
  "mistral-v0.1.jinja": { tokens: SENTENCEPIECE },
  "mistral-v0.3.jinja": { tokens: SENTENCEPIECE, tools: true },
  "mistral-nemo.jinja": { tokens: SENTENCEPIECE, tools: true },
  "mistral-small-3.1.jinja": {
    tokens: SENTENCEPIECE, tools: true, contentParts: true,
    // Python reads a backslash before a newline inside a string literal as a line
    // continuation (nothing); @huggingface/jinja refuses the escape. Joined here as Python would.
    hfSource: (source) => source.replaceAll("\\\n", ""),
  },
  "qwen2.5.jinja": { tokens: QWEN, tools: true },
  "qwen3.jinja": { tokens: QWEN, tools: true, thinking: true },
  "zephyr.jinja": { tokens: SENTENCEPIECE },
  "chatml.jinja": { tokens: { bos_token: "<s>", eos_token: "<|im_end|>" } },
  "gemma2.jinja": { tokens: GEMMA },
  "gemma3.jinja": { tokens: GEMMA, contentParts: true },
  "phi3.jinja": { tokens: { bos_token: "<s>", eos_token: "<|endoftext|>" } },
};

// ---- the conversations ----

const system = { role: "system", content: "You are a concise assistant. Answer in one sentence." };
const question = { role: "user", content: "What is GPTQ?" };
const answer = { role: "assistant", content: "A post-training method that quantizes weights to 2-8 bits." };
const followUp = { role: "user", content: "Does it need calibration data?" };

const GENERIC = {
  "one user message": [question],
  "system and user": [system, question],
  "multi-turn with system": [system, question, answer, followUp],
  "multi-turn ending with the assistant": [
    question, answer, followUp, { role: "assistant", content: "Yes, a few hundred samples." }],
  "unicode and whitespace": [
    { role: "system", content: "  Réponds en français, s'il te plaît.\n" },
    { role: "user", content: "  Ça va ? 你好 👩‍💻 naïve café\t«quotes» \"double\" 'single' {{ not a tag }}\n\n" },
    { role: "assistant", content: "\n  Très bien, merci ! 🎉  \n" },
    { role: "user", content: "Line one\nLine two\r\n    indented\u00a0and\u00a0spaced" },
  ],
  "two user messages in a row": [question, followUp],
};

const TOOLS = [
  {
    type: "function",
    function: {
      name: "get_weather",
      description: "Get the current weather in a city",
      parameters: {
        type: "object",
        properties: {
          city: { type: "string", description: "The city, e.g. Paris" },
          unit: { type: "string", enum: ["celsius", "fahrenheit"] },
        },
        required: ["city"],
      },
    },
  },
  {
    type: "function",
    function: {
      name: "get_time",
      description: "Get the local time in a city",
      parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] },
    },
  },
];

const weatherQuestion = { role: "user", content: "What's the weather in Paris?" };
const TOOL_CONVERSATIONS = {
  "tools offered": [weatherQuestion],
  "tools offered with system": [system, weatherQuestion],
  "tool call and result": [
    weatherQuestion,
    {
      role: "assistant",
      content: "",
      tool_calls: [{
        id: "call12345",
        type: "function",
        function: { name: "get_weather", arguments: { city: "Paris", unit: "celsius" } },
      }],
    },
    { role: "tool", tool_call_id: "call12345", name: "get_weather",
      content: "{\"temperature\": 21, \"condition\": \"sunny\"}" },
    { role: "assistant", content: "It is 21 °C and sunny in Paris." },
    { role: "user", content: "And in Tokyo?" },
  ],
};

// The same conversations as OpenAI's clients send them to /v1/chat/completions: arguments as
// JSON text, content null beside tool_calls, results in `tool` messages with their
// tool_call_id. Each is rendered (and recorded with its "request") in the form transformers'
// users pass it, which is how kestrel serve reads a request (engine/server/messages.cpp, as
// vLLM reads them): arguments that are a JSON object's text become that object, a null content
// "". tests/unit/test_tool_calls.cpp reads the request with the server's parser and renders it
// with the model's template through ChatTemplate, to the bytes recorded here.
const OPENAI_CONVERSATIONS = {
  "openai request, tools offered": [weatherQuestion],
  "openai request, a call and its result": [
    weatherQuestion,
    {
      role: "assistant",
      content: null,
      tool_calls: [{
        id: "call12345",
        type: "function",
        function: { name: "get_weather", arguments: "{\"city\": \"Paris\", \"unit\": \"celsius\"}" },
      }],
    },
    { role: "tool", tool_call_id: "call12345", content: "{\"temperature\": 21, \"condition\": \"sunny\"}" },
  ],
  "openai request, a call, its result and the answer": [
    { role: "system", content: "Use the tools when they help." },
    weatherQuestion,
    {
      role: "assistant",
      content: null,
      tool_calls: [{
        id: "callABCDE",
        type: "function",
        function: { name: "get_time", arguments: "{\"city\": \"Paris\"}" },
      }],
    },
    { role: "tool", tool_call_id: "callABCDE", content: "09:26" },
    { role: "assistant", content: "It is 09:26 in Paris." },
    { role: "user", content: "Thanks. And the weather?" },
  ],
};

// A request's messages as kestrel serve passes them to the template.
function asServerReads(messages) {
  return messages.map((m) => {
    const out = { role: m.role, content: m.content ?? "" };
    if (m.tool_calls) {
      out.tool_calls = m.tool_calls.map((c) => {
        let args = c.function.arguments;
        try {
          const parsed = JSON.parse(args);
          if (parsed !== null && typeof parsed === "object" && !Array.isArray(parsed)) args = parsed;
        } catch { /* not JSON: stays text */ }
        return { id: c.id, type: "function", function: { name: c.function.name, arguments: args } };
      });
    }
    if (m.tool_call_id !== undefined) out.tool_call_id = m.tool_call_id;
    if (m.name !== undefined) out.name = m.name;
    return out;
  });
}

// ---- the cases ----

const cases = [];
function add(templateName, name, context, request) {
  const spec = TEMPLATES[templateName];
  const file = fs.readFileSync(path.join(dataDir, templateName), "utf8");
  const source = spec.hfSource ? spec.hfSource(file) : file;
  const entry = { template: templateName, name, context };
  if (request) entry.request = request;
  try {
    entry.expected = render(source, context);
  } catch (e) {
    if (!(e instanceof Raised)) throw new Error(`${templateName} / ${name}: ${e.message}`);
    entry.error = e.message; // the template refuses the conversation: raise_exception(message)
  }
  cases.push(entry);
}

for (const [templateName, spec] of Object.entries(TEMPLATES)) {
  for (const [name, messages] of Object.entries(GENERIC)) {
    for (const generation of [true, false]) {
      add(templateName, `${name}, add_generation_prompt=${generation}`,
          { messages, add_generation_prompt: generation, ...spec.tokens });
    }
  }
  if (spec.tools) {
    for (const [name, messages] of Object.entries(TOOL_CONVERSATIONS)) {
      add(templateName, name, { messages, tools: TOOLS, add_generation_prompt: true, ...spec.tokens });
    }
    // date_string: Llama 3.2's template writes today's date without it.
    const kwargs = { date_string: "14 Mar 2025" };
    for (const [name, messages] of Object.entries(OPENAI_CONVERSATIONS)) {
      add(templateName, name,
          { messages: asServerReads(messages), tools: TOOLS, add_generation_prompt: true, ...spec.tokens, ...kwargs },
          { messages, tools: TOOLS, tool_choice: "auto", chat_template_kwargs: kwargs });
    }
  }
  if (spec.dates) {
    add(templateName, "date_string given",
        { messages: [question], add_generation_prompt: true, date_string: "01 Feb 2025", ...spec.tokens });
  }
  if (spec.contentParts) {
    add(templateName, "content as a list of parts", {
      messages: [
        { role: "system", content: [{ type: "text", text: "Describe images briefly." }] },
        { role: "user", content: [{ type: "image" }, { type: "text", text: "What is in this picture?" }] },
      ],
      add_generation_prompt: true,
      ...spec.tokens,
    });
  }
  if (spec.thinking) {
    const math = { role: "user", content: "What is 2+2?" };
    add(templateName, "enable_thinking=false",
        { messages: [math], add_generation_prompt: true, enable_thinking: false, ...spec.tokens });
    add(templateName, "enable_thinking=true",
        { messages: [math], add_generation_prompt: true, enable_thinking: true, ...spec.tokens });
    add(templateName, "thinking in the history", {
      messages: [math, { role: "assistant", content: "<think>\nAdd the numbers.\n</think>\n\n2 + 2 = 4." },
                 { role: "user", content: "And 3+3?" }],
      add_generation_prompt: true,
      ...spec.tokens,
    });
    add(templateName, "reasoning_content in the last reply", {
      messages: [math, { role: "assistant", content: "4", reasoning_content: "Simple addition." }],
      add_generation_prompt: false,
      ...spec.tokens,
    });
  }
}

const out = {
  generator: `scripts/make-jinja-goldens.mjs with @huggingface/jinja ${HF_JINJA_VERSION}`,
  strftime_now: FIXED_DATE,
  cases,
};
fs.writeFileSync(path.join(dataDir, "goldens.json"), JSON.stringify(out, null, 1) + "\n");
const errors = cases.filter((c) => c.error !== undefined).length;
console.log(`${cases.length} cases over ${Object.keys(TEMPLATES).length} templates ` +
            `(${errors} refused by raise_exception) -> tests/data/chat_templates/goldens.json`);
