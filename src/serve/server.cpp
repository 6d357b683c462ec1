// `nextlm serve`: the HTTP layer (cpp-httplib) over the scheduler. It parses and validates OpenAI-style requests,
// hands each one to the scheduler as a Job, and writes the answer in OpenAI's shapes, whole or as server-sent events.
#include "serve/server.h"

#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <optional>
#include <random>
#include <thread>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "cpu/linear.h"
#include "io/chat_template.h"
#include "io/tokenizer.h"
#include "model/config.h"
#include "model/lora.h"
#include "model/model.h"
#include "serve/backend.h"
#include "serve/scheduler.h"

namespace nextlm::serve {
namespace {

using nlohmann::json;

constexpr int64_t kMaxTopLogprobs = 20;  // as OpenAI
constexpr size_t kMaxStopStrings = 4;     // as OpenAI

// A request the server refuses, sent as {"error": {"message", "type", "param", "code"}}.
struct ApiError {
  int status = 400;
  std::string message, param, code;
  std::string type = "invalid_request_error";
};

[[noreturn]] void bad(const std::string& param, const std::string& code, const std::string& message) {
  throw ApiError{400, message, param, code};
}

json error_body(const ApiError& e) {
  return {{"error",
           {{"message", e.message},
            {"type", e.type},
            {"param", e.param.empty() ? json(nullptr) : json(e.param)},
            {"code", e.code.empty() ? json(nullptr) : json(e.code)}}}};
}

// Request strings may hold invalid UTF-8 (echoed in error messages); they are replaced rather than thrown on.
std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// What the request handlers need to know about the model and the server's limits.
struct Context {
  std::string model_name;
  int64_t vocab_size = 0;
  bool byte_level = false;  // vocab_size 256 and no tokenizer.json: text is UTF-8 bytes
  const Tokenizer* tokenizer = nullptr;  // the model directory's tokenizer.json, if it has one
  std::vector<int32_t> eos_tokens;       // load_eos_token_ids: end a request unless it sets ignore_eos
  int64_t max_tokens = 0;   // prompt + max_tokens of a request, at most: --max-tokens, or a smaller --max-len
  std::string limit_flag;   // the flag that set max_tokens
  int64_t created = 0;      // server start, Unix seconds
};

// A field, or nullptr when it is absent or null (OpenAI reads null as "the default").
const json* field(const json& body, const std::string& name) {
  const auto it = body.find(name);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

int64_t get_int(const json& body, const std::string& name, int64_t def, int64_t lo, int64_t hi) {
  const json* v = field(body, name);
  if (!v) return def;
  if (!v->is_number_integer()) bad(name, "invalid_type", name + " must be an integer");
  const bool too_big = v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(hi);
  const int64_t x = too_big ? hi : v->get<int64_t>();
  if (too_big || x < lo || x > hi)
    bad(name, "invalid_value",
        name + " must be from " + std::to_string(lo) + " to " + std::to_string(hi) + ", got " + v->dump());
  return x;
}

double get_number(const json& body, const std::string& name, double def) {
  const json* v = field(body, name);
  if (!v) return def;
  if (!v->is_number()) bad(name, "invalid_type", name + " must be a number");
  const double x = v->get<double>();
  if (!std::isfinite(x)) bad(name, "invalid_value", name + " must be finite");
  return x;
}

bool get_bool(const json& body, const std::string& name, bool def) {
  const json* v = field(body, name);
  if (!v) return def;
  if (!v->is_boolean()) bad(name, "invalid_type", name + " must be true or false");
  return v->get<bool>();
}

// The prompt of /v1/completions: a list of token ids, or a string for a byte-level model.
std::vector<int32_t> parse_prompt(const json& body, const Context& ctx) {
  const json* p = field(body, "prompt");
  if (!p) bad("prompt", "missing_field", "prompt is required");
  std::vector<int32_t> ids;
  if (p->is_string()) {
    if (ctx.tokenizer) {
      ids = ctx.tokenizer->encode(p->get<std::string>());  // JSON strings are valid UTF-8
    } else {
      if (!ctx.byte_level)
        bad("prompt", "tokenizer_unavailable",
            "a text prompt needs a tokenizer, which is not available for this model (no tokenizer.json, vocab_size " +
                std::to_string(ctx.vocab_size) + "); send the prompt as a list of token ids");
      for (unsigned char c : p->get<std::string>()) ids.push_back(c);
    }
  } else if (p->is_array()) {
    for (size_t i = 0; i < p->size(); ++i) {
      const json& t = (*p)[i];
      const std::string where = "prompt[" + std::to_string(i) + "]";
      if (!t.is_number_integer())
        bad("prompt", "invalid_type", where + " must be a token id (an integer); one prompt per request");
      const bool in_vocab = t.is_number_unsigned() ? t.get<uint64_t>() < static_cast<uint64_t>(ctx.vocab_size)
                                                   : t.get<int64_t>() >= 0 && t.get<int64_t>() < ctx.vocab_size;
      if (!in_vocab)
        bad("prompt", "invalid_value",
            where + ": token id " + t.dump() + " is outside the vocabulary [0, " + std::to_string(ctx.vocab_size) + ")");
      ids.push_back(static_cast<int32_t>(t.get<int64_t>()));
    }
  } else {
    bad("prompt", "invalid_type", "prompt must be a list of token ids or a string");
  }
  if (ids.empty()) bad("prompt", "invalid_value", "prompt is empty");
  return ids;
}

// Chat rendering. With a tokenizer: GLM's chat format (io/chat_template.h; a "developer" message is a system
// message), encoded with the tokenizer. Byte-level models without one: each message becomes "<|role|>\n" + content +
// "\n", and "<|assistant|>\n" follows the last one, as UTF-8 bytes.
std::vector<int32_t> render_chat(const json& body, const Context& ctx) {
  if (!ctx.byte_level && !ctx.tokenizer)
    throw ApiError{400,
                   "chat needs the model's chat template, which comes with the tokenizer and is not available "
                   "for this model (no tokenizer.json, vocab_size " + std::to_string(ctx.vocab_size) +
                       "); use /v1/completions with a list of token ids",
                   "messages", "chat_template_unavailable"};
  const json* m = field(body, "messages");
  if (!m) bad("messages", "missing_field", "messages is required");
  if (!m->is_array() || m->empty()) bad("messages", "invalid_type", "messages must be a non-empty list");
  std::string text;
  std::vector<ChatMessage> messages;
  for (size_t i = 0; i < m->size(); ++i) {
    const json& msg = (*m)[i];
    const std::string where = "messages[" + std::to_string(i) + "]";
    if (!msg.is_object()) bad("messages", "invalid_type", where + " must be an object");
    const json* role = field(msg, "role");
    const json* content = field(msg, "content");
    if (!role || !role->is_string()) bad("messages", "invalid_type", where + ".role must be a string");
    const std::string r = role->get<std::string>();
    if (r != "system" && r != "developer" && r != "user" && r != "assistant" && r != "tool")
      bad("messages", "invalid_value", where + ".role \"" + r + "\" is not system, developer, user, assistant or tool");
    if (!content || !content->is_string()) bad("messages", "invalid_type", where + ".content must be a string");
    text += "<|" + r + "|>\n" + content->get<std::string>() + "\n";
    messages.push_back({r == "developer" ? "system" : r, content->get<std::string>()});
  }
  if (ctx.tokenizer) return ctx.tokenizer->encode(render_glm_chat(messages));
  text += "<|assistant|>\n";
  std::vector<int32_t> ids;
  for (unsigned char c : text) ids.push_back(c);
  return ids;
}

// A validated request.
struct Parsed {
  JobRequest job;
  const Tokenizer* tokenizer = nullptr;  // the text of tokens: the tokenizer's bytes, else bytes or ids
  bool chat = false;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage: a last chunk with the usage
  int64_t logprobs = -1;       // −1: none; else the chosen tokens' logprobs and this many alternatives
};

Parsed parse_request(const json& body, const Context& ctx, bool chat) {
  if (!body.is_object()) bad("", "invalid_type", "the request body must be a JSON object");
  Parsed p;
  p.chat = chat;
  JobRequest& r = p.job;
  r.byte_level = ctx.byte_level;
  r.tokenizer = p.tokenizer = ctx.tokenizer;
  if (const json* m = field(body, "model"); m && !m->is_string()) bad("model", "invalid_type", "model must be a string");
  r.prompt = chat ? render_chat(body, ctx) : parse_prompt(body, ctx);
  get_int(body, "n", 1, 1, 1);  // one choice per request

  const std::string max_name = chat && field(body, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
  r.max_tokens = get_int(body, max_name, 16, 0, ctx.max_tokens);
  const int64_t prompt_len = static_cast<int64_t>(r.prompt.size());
  if (prompt_len + r.max_tokens > ctx.max_tokens)
    bad(max_name, "context_length_exceeded",
        "the prompt (" + std::to_string(prompt_len) + " tokens) plus " + max_name + " (" +
            std::to_string(r.max_tokens) + ") is more than this server's limit of " + std::to_string(ctx.max_tokens) +
            " tokens (" + ctx.limit_flag + ")");

  SamplingOptions& s = r.sampling;
  s.temperature = get_number(body, "temperature", 1.0);
  if (s.temperature < 0) bad("temperature", "invalid_value", "temperature must be >= 0 (0 is greedy)");
  s.top_p = get_number(body, "top_p", 1.0);
  if (!(s.top_p > 0 && s.top_p <= 1)) bad("top_p", "invalid_value", "top_p must be in (0, 1]");
  s.top_k = get_int(body, "top_k", 0, 0, ctx.vocab_size);
  s.min_p = get_number(body, "min_p", 0.0);
  if (!(s.min_p >= 0 && s.min_p <= 1)) bad("min_p", "invalid_value", "min_p must be in [0, 1]");
  if (const json* seed = field(body, "seed")) {
    if (!seed->is_number_integer()) bad("seed", "invalid_type", "seed must be an integer");
    if (!seed->is_number_unsigned() && seed->get<int64_t>() < 0) bad("seed", "invalid_value", "seed must be >= 0");
    s.seed = seed->get<uint64_t>();
  } else {
    s.seed = std::random_device{}();  // no seed: a different draw each time, as OpenAI
    s.seed = (s.seed << 32) ^ std::random_device{}();
  }

  if (chat) {
    const bool want = get_bool(body, "logprobs", false);
    const int64_t top = get_int(body, "top_logprobs", 0, 0, kMaxTopLogprobs);
    if (field(body, "top_logprobs") && !want) bad("top_logprobs", "invalid_value", "top_logprobs needs logprobs: true");
    p.logprobs = want ? top : -1;
  } else {
    p.logprobs = get_int(body, "logprobs", -1, 0, kMaxTopLogprobs);
  }
  s.top_logprobs = std::max<int64_t>(p.logprobs, 0);

  if (const json* stop = field(body, "stop")) {
    if (stop->is_string()) {
      r.stop_strings.push_back(stop->get<std::string>());
    } else if (stop->is_array()) {
      for (const json& x : *stop) {
        if (!x.is_string()) bad("stop", "invalid_type", "stop must be a string or a list of strings");
        r.stop_strings.push_back(x.get<std::string>());
      }
    } else {
      bad("stop", "invalid_type", "stop must be a string or a list of strings");
    }
    if (r.stop_strings.size() > kMaxStopStrings)
      bad("stop", "invalid_value",
          "at most " + std::to_string(kMaxStopStrings) + " stop strings, got " + std::to_string(r.stop_strings.size()));
    for (const std::string& x : r.stop_strings)
      if (x.empty()) bad("stop", "invalid_value", "stop strings must not be empty");
    if (!ctx.byte_level && !ctx.tokenizer && !r.stop_strings.empty())
      bad("stop", "tokenizer_unavailable",
          "stop strings need the model's text, which is not available for this model (no tokenizer.json, vocab_size " +
              std::to_string(ctx.vocab_size) + "); use stop_token_ids");
  }
  // vLLM's extension: the model's eos tokens end generation (they are in the tokens and logprobs, not in the text)
  // unless ignore_eos is true.
  if (!get_bool(body, "ignore_eos", false)) r.eos_tokens = ctx.eos_tokens;
  if (const json* ids = field(body, "stop_token_ids")) {
    if (!ids->is_array()) bad("stop_token_ids", "invalid_type", "stop_token_ids must be a list of token ids");
    for (const json& x : *ids) {
      if (!x.is_number_integer()) bad("stop_token_ids", "invalid_type", "stop_token_ids must be a list of token ids");
      if (x.is_number_unsigned() ? x.get<uint64_t>() >= static_cast<uint64_t>(ctx.vocab_size)
                                 : (x.get<int64_t>() < 0 || x.get<int64_t>() >= ctx.vocab_size))
        bad("stop_token_ids", "invalid_value",
            "stop token id " + x.dump() + " is outside the vocabulary [0, " + std::to_string(ctx.vocab_size) + ")");
      r.stop_tokens.push_back(static_cast<int32_t>(x.get<int64_t>()));
    }
  }

  p.stream = get_bool(body, "stream", false);
  if (const json* so = field(body, "stream_options")) {
    if (!so->is_object()) bad("stream_options", "invalid_type", "stream_options must be an object");
    p.include_usage = get_bool(*so, "include_usage", false);
  }
  try {
    validate(s);  // the same rules as `generate`; the checks above give the friendlier messages first
  } catch (const Error& e) {
    bad("", "invalid_value", e.what());
  }
  return p;
}

// A token as text in logprobs: with a tokenizer, its bytes as UTF-8 (ill-formed parts as U+FFFD); else the character
// of an ASCII byte, "bytes:\xNN" for other bytes (as OpenAI writes partial UTF-8), the id in decimal for a model
// without a tokenizer.
std::string token_text(int32_t token, bool byte_level, const Tokenizer* tok) {
  if (tok) return utf8_lossy(tok->token_bytes(token));
  if (!byte_level) return std::to_string(token);
  if (token < 0x80) return std::string(1, static_cast<char>(token));
  char buf[32];
  std::snprintf(buf, sizeof buf, "bytes:\\x%02x", static_cast<unsigned>(token));
  return buf;
}

json token_bytes(int32_t token, bool byte_level, const Tokenizer* tok) {
  if (tok) {
    json b = json::array();
    for (unsigned char c : tok->token_bytes(token)) b.push_back(c);
    return b;
  }
  return byte_level ? json::array({token}) : json(nullptr);
}

// The UTF-8 bytes of samples [a, b): the tokenizer's bytes of each token, or the tokens as bytes (byte-level).
std::string bytes_of(const std::vector<Sample>& samples, size_t a, size_t b, const Tokenizer* tok) {
  std::string s;
  for (size_t i = a; i < b; ++i) {
    if (tok) s += tok->token_bytes(samples[i].token);
    else s.push_back(static_cast<char>(samples[i].token));
  }
  return s;
}

// The logprobs object of samples [a, b): /v1/completions' legacy shape, or chat's {"content": [...]}. Text offsets
// are byte offsets into the completion (0 for models without a tokenizer).
json logprobs_json(const std::vector<Sample>& samples, size_t a, size_t b, const Parsed& p) {
  const bool bl = p.job.byte_level;
  const Tokenizer* tk = p.tokenizer;
  if (p.chat) {
    json content = json::array();
    for (size_t i = a; i < b; ++i) {
      json top = json::array();
      for (const TokenLogprob& t : samples[i].top)
        top.push_back({{"token", token_text(t.token, bl, tk)}, {"logprob", t.logprob},
                       {"bytes", token_bytes(t.token, bl, tk)}});
      content.push_back({{"token", token_text(samples[i].token, bl, tk)},
                         {"logprob", samples[i].logprob},
                         {"bytes", token_bytes(samples[i].token, bl, tk)},
                         {"top_logprobs", top}});
    }
    return {{"content", content}};
  }
  json tokens = json::array(), lps = json::array(), tops = json::array(), offsets = json::array(), ids = json::array();
  size_t offset = tk ? bytes_of(samples, 0, a, tk).size() : a;  // byte offset of sample i into the completion
  for (size_t i = a; i < b; ++i) {
    tokens.push_back(token_text(samples[i].token, bl, tk));
    lps.push_back(samples[i].logprob);
    offsets.push_back(bl || tk ? offset : 0);
    offset += tk ? tk->token_bytes(samples[i].token).size() : 1;
    ids.push_back(samples[i].token);
    json top = json::object();
    for (const TokenLogprob& t : samples[i].top) top[token_text(t.token, bl, tk)] = t.logprob;
    tops.push_back(top);
  }
  return {{"tokens", tokens},
          {"token_logprobs", lps},
          {"top_logprobs", p.logprobs > 0 ? tops : json(nullptr)},
          {"text_offset", offsets},
          {"token_ids", ids}};
}

json usage_json(const Parsed& p, size_t completion) {
  const size_t prompt = p.job.prompt.size();
  return {{"prompt_tokens", prompt}, {"completion_tokens", completion}, {"total_tokens", prompt + completion}};
}

std::string sse(const json& j) { return "data: " + dump(j) + "\n\n"; }

std::string new_id(const char* prefix) {
  static std::atomic<uint64_t> counter{0};
  static const uint64_t salt = std::random_device{}();
  char buf[48];
  std::snprintf(buf, sizeof buf, "%s-%08llx%06llx", prefix, static_cast<unsigned long long>(salt & 0xffffffff),
                static_cast<unsigned long long>(++counter));
  return buf;
}

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

class Api {
 public:
  Api(const Context& ctx, Scheduler& sched) : ctx_(ctx), sched_(sched) {}
  std::atomic<bool> draining{false};  // set on SIGINT/SIGTERM: new requests get 503

  void models(httplib::Response& res) const {
    json m = {{"id", ctx_.model_name},
              {"object", "model"},
              {"created", ctx_.created},
              {"owned_by", "nextlm"},
              {"max_model_len", ctx_.max_tokens}};
    res.set_content(dump({{"object", "list"}, {"data", json::array({m})}}), "application/json");
  }

  void health(httplib::Response& res) const {
    const bool d = draining.load();
    res.status = d ? 503 : 200;
    res.set_content(dump({{"status", d ? "shutting_down" : "ok"},
                          {"active", sched_.active()},
                          {"queued", sched_.queued()}}),
                    "application/json");
  }

  void generate(const httplib::Request& req, httplib::Response& res, bool chat) {
    try {
      if (draining) throw ApiError{503, "the server is shutting down", "", "shutting_down", "server_error"};
      json body;
      try {
        body = json::parse(req.body);
      } catch (const json::parse_error& e) {
        bad("", "invalid_json", std::string("the request body is not valid JSON: ") + e.what());
      }
      auto p = std::make_shared<const Parsed>(parse_request(body, ctx_, chat));
      auto job = std::make_shared<Job>(p->job);
      sched_.submit(job);
      if (p->stream) {
        stream(res, p, job);
      } else {
        whole(res, *p, *job);
      }
    } catch (const ApiError& e) {
      res.status = e.status;
      res.set_content(dump(error_body(e)), "application/json");
    } catch (const std::exception& e) {
      res.status = 500;
      res.set_content(dump(error_body(ApiError{500, e.what(), "", "internal_error", "server_error"})),
                      "application/json");
    }
  }

 private:
  json header(const std::string& id, const char* object) const {
    return {{"id", id}, {"object", object}, {"created", unix_now()}, {"model", ctx_.model_name}};
  }

  // The choice for samples [a, b) with text `t`: a whole answer (text or message) or a stream chunk (text or delta).
  // The text is cut from the output's bytes (Job::Snapshot::text) rather than made from tokens [a, b): it ends
  // before a stop string or an eos token, and a stream cuts it at whole characters, neither of which need fall
  // between tokens.
  json choice(const Parsed& p, const std::vector<Sample>& s, size_t a, size_t b, bool delta, const json& reason,
              const std::string& t) const {
    json ids = json::array();
    for (size_t i = a; i < b; ++i) ids.push_back(s[i].token);
    json c = {{"index", 0}};
    if (!p.chat) c["text"] = t;
    else if (delta) c["delta"] = b > a || !t.empty() ? json{{"content", t}} : json::object();
    else c["message"] = {{"role", "assistant"}, {"content", t}};
    c["logprobs"] = p.logprobs >= 0 && (b > a || !delta) ? logprobs_json(s, a, b, p) : json(nullptr);
    c["finish_reason"] = reason;
    c["tokens"] = ids;  // extension: the token ids of this text
    return c;
  }

  void whole(httplib::Response& res, const Parsed& p, const Job& job) const {
    Job::Snapshot s = job.snapshot();
    while (!s.finished) {
      job.wait(s.samples.size(), 1000);
      s = job.snapshot();
    }
    if (s.finish_reason == "error")
      throw ApiError{500, "generation failed: " + s.error, "", "generation_failed", "server_error"};
    json out = header(new_id(p.chat ? "chatcmpl" : "cmpl"), p.chat ? "chat.completion" : "text_completion");
    const std::string text = utf8_text(s.bytes.substr(0, s.text), true);
    out["choices"] = json::array({choice(p, s.samples, 0, s.shown, false, s.finish_reason, text)});
    out["usage"] = usage_json(p, s.samples.size());
    res.set_content(dump(out), "application/json");
  }

  // Server-sent events: chunks as text becomes showable (whole UTF-8 characters, nothing that may be the start of a
  // stop string: Job::Snapshot::text), each with the tokens whose bytes it completes; once finished, the rest of
  // the text (cut before a stop string or an eos token) and of the kept tokens, then a chunk with the finish_reason,
  // optionally one with the usage, then "data: [DONE]".
  void stream(httplib::Response& res, std::shared_ptr<const Parsed> p, std::shared_ptr<Job> job) const {
    struct Progress {
      size_t sent = 0;        // tokens sent
      size_t bytes_sent = 0;  // bytes of the output sent as text
      size_t seen = 0;        // tokens seen in the last snapshot
      bool started = false;
    };
    auto pr = std::make_shared<Progress>();
    const std::string id = new_id(p->chat ? "chatcmpl" : "cmpl");
    const char* object = p->chat ? "chat.completion.chunk" : "text_completion";
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider(
        "text/event-stream",
        [this, p, job, pr, id, object](size_t, httplib::DataSink& sink) {
          job->wait(pr->seen, 200);
          const Job::Snapshot s = job->snapshot();
          pr->seen = s.samples.size();
          // The whole characters of the showable text not sent yet (all of it once finished: the cut is final).
          std::string text;
          if (s.text > pr->bytes_sent) {
            size_t used = 0;
            text = utf8_text(s.bytes.substr(pr->bytes_sent, s.text - pr->bytes_sent), s.finished, &used);
            pr->bytes_sent += used;
          }
          // The showable tokens whose bytes are all sent, so that a chunk's logprobs go with its text; once
          // finished, every kept token (one that straddles a stop string has bytes that are never sent).
          size_t end = pr->sent;
          while (end < s.shown && (s.finished || s.ends[end] <= pr->bytes_sent)) ++end;
          std::string out;
          if (p->chat && !pr->started) {
            json c = header(id, object);
            c["choices"] = json::array(
                {{{"index", 0}, {"delta", {{"role", "assistant"}, {"content", ""}}}, {"logprobs", nullptr},
                  {"finish_reason", nullptr}}});
            out += sse(c);
          }
          pr->started = true;
          if (end > pr->sent || !text.empty()) {
            json c = header(id, object);
            c["choices"] =
                json::array({choice(*p, s.samples, pr->sent, end, true, nullptr, text)});
            out += sse(c);
            pr->sent = end;
          }
          if (s.finished) {
            if (s.finish_reason == "error") {
              out += sse(error_body(ApiError{500, "generation failed: " + s.error, "", "generation_failed", "server_error"}));
            } else {
              json c = header(id, object);
              c["choices"] = json::array({choice(*p, s.samples, end, end, true, s.finish_reason, "")});
              out += sse(c);
              if (p->include_usage) {
                json u = header(id, object);
                u["choices"] = json::array();
                u["usage"] = usage_json(*p, s.samples.size());
                out += sse(u);
              }
            }
            out += "data: [DONE]\n\n";
          }
          if (!out.empty() && !sink.write(out.data(), out.size())) {
            job->cancel();
            return false;
          }
          if (s.finished) sink.done();
          return true;
        },
        [job](bool success) {
          if (!success) job->cancel();
        });
  }

  const Context& ctx_;
  Scheduler& sched_;
};

// SIGINT/SIGTERM: the handler only writes a byte to a pipe; a watcher thread does the rest.
int g_signal_pipe[2] = {-1, -1};

extern "C" void on_signal(int) {
  const char c = 's';
  [[maybe_unused]] ssize_t n = ::write(g_signal_pipe[1], &c, 1);
}

std::string model_name(std::string dir) {
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  const size_t slash = dir.rfind('/');
  return slash == std::string::npos ? dir : dir.substr(slash + 1);
}

}  // namespace

int64_t decoder_max_len(const ServeOptions& opt) {
  if (opt.max_len > 0) return opt.max_len;
  int64_t len = std::min(opt.max_tokens, kDefaultMaxLen);
  // ModelConfig does not keep max_position_embeddings (the NoPE model has no use for it), so it is read here.
  std::ifstream f(opt.model_dir + "/config.json");
  const json cfg = json::parse(f, nullptr, false);
  if (cfg.is_object()) {
    const json& text = cfg.contains("text_config") && cfg["text_config"].is_object() ? cfg["text_config"] : cfg;
    if (const json* m = field(text, "max_position_embeddings"); m && m->is_number_integer() && m->get<int64_t>() >= 2)
      len = std::min(len, m->get<int64_t>());
  }
  return len;
}

namespace {

void check_options(const ServeOptions& opt) {
  check(opt.max_batch >= 1, "--max-batch must be >= 1, got ", opt.max_batch);
  check(opt.max_tokens >= 2, "--max-tokens must be >= 2, got ", opt.max_tokens);
  check(opt.port >= 0 && opt.port <= 65535, "--port must be from 0 to 65535, got ", opt.port);
  check(opt.device == "cpu" || opt.device == "cuda", "--device must be cpu or cuda, got \"", opt.device, "\"");
  check(opt.device == "cuda" || (opt.max_len == 0 && !opt.batch_invariant),
        "--max-len and --batch-invariant apply to --device cuda only");
  check(opt.max_len == 0 || opt.max_len >= 2, "--max-len must be >= 2, got ", opt.max_len);
}

}  // namespace

int run_server(const ServeOptions& opt) {
  check_options(opt);
  cpu::set_num_threads(opt.threads);

  // The model on its device and the scheduler's decoder over it (both outlive the scheduler).
  std::optional<Model> model;
  std::unique_ptr<DecodeBackend> backend;
  const ModelConfig* config = nullptr;
#ifdef NEXTLM_HAVE_CUDA
  std::unique_ptr<CudaModel> gpu;
#endif
  if (opt.device == "cuda") {
#ifdef NEXTLM_HAVE_CUDA
    // Straight from the checkpoint in bf16, as `generate --device cuda` loads it (with an adapter, as it loads
    // that: merged into the fp32 host weights first).
    gpu = opt.adapter.empty() ? CudaModel::load(opt.model_dir)
                              : std::make_unique<CudaModel>(load_model_with_adapter(opt.model_dir, opt.adapter));
    gpu->set_batch_invariant(opt.batch_invariant);
    backend = std::make_unique<CudaBackend>(*gpu, opt.max_batch, decoder_max_len(opt));
    config = &gpu->config();
#else
    fail("--device cuda needs a build with the CUDA backend (NEXTLM_CUDA)");
#endif
  } else {
    model.emplace(load_model_with_adapter(opt.model_dir, opt.adapter));  // no adapter: the model as it is
    backend = std::make_unique<CpuBackend>(*model, opt.max_batch, opt.threads);
    config = &model->config();
  }
  return run_server(opt, std::move(backend), *config);
}

int run_server(const ServeOptions& opt, std::unique_ptr<DecodeBackend> backend, const ModelConfig& model_config) {
  check_options(opt);
  const ModelConfig* config = &model_config;
  Context ctx;
  ctx.model_name = model_name(opt.model_dir);
  ctx.vocab_size = config->vocab_size;
  // A tokenizer.json beside the checkpoint gives text prompts, chat and text output; without one a byte-level model
  // (vocab 256) reads and writes UTF-8 bytes.
  std::optional<Tokenizer> tokenizer;
  if (const std::string tj = opt.model_dir + "/tokenizer.json"; ::access(tj.c_str(), F_OK) == 0) {
    tokenizer = Tokenizer::load(tj);
    check(tokenizer->vocab_size() <= ctx.vocab_size, tj, " has ids up to ", tokenizer->vocab_size() - 1,
          ", outside the model's vocabulary [0, ", ctx.vocab_size, ")");
    ctx.tokenizer = &*tokenizer;
  }
  ctx.byte_level = !tokenizer && ctx.vocab_size == 256;
  ctx.eos_tokens = load_eos_token_ids(opt.model_dir, *config);
  ctx.max_tokens = opt.max_tokens;
  ctx.limit_flag = "--max-tokens";
  if (backend->max_len() > 0 && backend->max_len() < ctx.max_tokens)
    ctx.max_tokens = backend->max_len(), ctx.limit_flag = "--max-len";
  ctx.created = unix_now();

  Scheduler sched(std::move(backend));
  Api api(ctx, sched);
  httplib::Server svr;
  // Every waiting or streaming request holds a worker thread, so allow well over max_batch of them.
  const size_t workers = static_cast<size_t>(std::max<int64_t>(16, 4 * opt.max_batch));
  svr.new_task_queue = [workers] { return new httplib::ThreadPool(workers); };
  svr.set_keep_alive_timeout(1);  // an idle keep-alive connection delays shutdown by at most this
  svr.set_payload_max_length(16 << 20);
  svr.Get("/health", [&](const httplib::Request&, httplib::Response& res) { api.health(res); });
  svr.Get("/v1/models", [&](const httplib::Request&, httplib::Response& res) { api.models(res); });
  svr.Post("/v1/completions",
           [&](const httplib::Request& req, httplib::Response& res) { api.generate(req, res, false); });
  svr.Post("/v1/chat/completions",
           [&](const httplib::Request& req, httplib::Response& res) { api.generate(req, res, true); });
  // Unknown paths, wrong methods and too-large bodies get an OpenAI-style body too.
  svr.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    const std::string msg = res.status == 404   ? "no route " + req.method + " " + req.path
                            : res.status == 413 ? std::string("the request body is too large")
                                                : "HTTP status " + std::to_string(res.status);
    res.set_content(dump(error_body(ApiError{res.status, msg, "", res.status == 404 ? "not_found" : ""})),
                    "application/json");
  });

  // This cpp-httplib build listens with a backlog of 5, so a burst of new connections has SYNs dropped and retried
  // a second later. The socket-options hook sees the listening socket; the backlog is raised once it listens.
  int listen_fd = -1;
  svr.set_socket_options([&listen_fd](socket_t sock) {
    httplib::default_socket_options(sock);
    listen_fd = sock;
  });
  int port = opt.port;
  if (port == 0) {
    port = svr.bind_to_any_port(opt.host);
    check(port > 0, "cannot listen on ", opt.host, " (any port)");
  } else {
    check(svr.bind_to_port(opt.host, port), "cannot listen on ", opt.host, ":", port);
  }
  if (listen_fd >= 0) ::listen(listen_fd, SOMAXCONN);

  check(::pipe(g_signal_pipe) == 0, "cannot create the signal pipe");
  struct sigaction sa = {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  std::thread watcher([&] {
    char c = 0;
    while (::read(g_signal_pipe[0], &c, 1) < 0 && errno == EINTR) {
    }
    if (c == 's') std::cerr << "serve: shutting down: finishing the requests in flight\n" << std::flush;
    api.draining = true;
    svr.stop();
  });

  std::cerr << "serve: model " << ctx.model_name << " (vocab " << ctx.vocab_size
            << (tokenizer ? ", tokenizer.json" : ctx.byte_level ? ", bytes" : ", token ids only") << ", eos "
            << (ctx.eos_tokens.empty() ? std::string("none") : dump(ctx.eos_tokens)) << "), device " << opt.device
            << (opt.batch_invariant ? " (batch-invariant)" : "")
            << (opt.tp > 1 || opt.ep > 1 ? " (tp " + std::to_string(opt.tp) + ", ep " + std::to_string(opt.ep) + ")"
                                         : std::string())
            << ", max batch " << opt.max_batch
            << ", max tokens " << ctx.max_tokens << " (" << ctx.limit_flag << ")\n";
  std::cout << "listening on http://" << opt.host << ":" << port << std::endl;
  svr.listen_after_bind();  // returns once stopped and every handler has returned

  const char quit = 'q';  // wakes the watcher when the server stopped on its own
  [[maybe_unused]] ssize_t n = ::write(g_signal_pipe[1], &quit, 1);
  watcher.join();
  std::cerr << "serve: stopped\n";
  return 0;
}

}  // namespace nextlm::serve
