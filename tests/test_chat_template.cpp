// Chat templates (src/text/chat_template.*, src/text/jinja_*): rendering must match Jinja2 as Hugging
// Face's apply_chat_template configures it, byte for byte, on real model templates (MiniMax M2/M3,
// Qwen, Llama 3, DeepSeek, Hermes) and on feature templates of our own, over conversations with system
// prompts, multi-turn chat, tool definitions and calls, reasoning, unicode and special characters.
//
// The expected outputs are not committed: tests/chat_template/render_reference.py renders them with
// Jinja2 when the test runs (python3 with jinja2 is a test dependency; scripts/test.sh installs it).
// Bad templates and bad input must fail with a tpmoe::Error that says what and where, never crash.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <random>
#include <sstream>

#include "core/error.h"
#include "test_util.h"
#include "text/chat_template.h"

namespace tpmoe::text {
namespace {

const std::filesystem::path kDataDir = std::filesystem::path(__FILE__).parent_path() / "chat_template";

std::string read_text(const std::filesystem::path& path) { return test::read_text_file(path); }

nlohmann::ordered_json read_json(const std::filesystem::path& path) {
  return nlohmann::ordered_json::parse(read_text(path));
}

void write_text(const std::filesystem::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

// Runs the Jinja2 reference renderer; null (and a test failure with its output) when it cannot run.
nlohmann::ordered_json render_reference() {
  const auto out = test::make_temp_dir("chat_template_reference") / "expected.json";
  const std::string cmd =
      "python3 '" + (kDataDir / "render_reference.py").string() + "' --out '" + out.string() + "' 2>&1";
  std::string log;
  FILE* pipe = popen(cmd.c_str(), "r");
  if (!pipe) {
    ADD_FAILURE() << "cannot run: " << cmd;
    return nullptr;
  }
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof(buf), pipe)) log.append(buf, n);
  const int status = pclose(pipe);
  if (status != 0) {
    ADD_FAILURE() << "render_reference.py failed (it needs python3 with jinja2==3.1.6, which scripts/test.sh "
                     "installs):\n"
                  << log;
    return nullptr;
  }
  std::printf("%s", log.c_str());
  return read_json(out);
}

// Where two strings first differ, with a little context, escaped for the terminal.
std::string describe_difference(const std::string& want, const std::string& got) {
  size_t i = 0;
  while (i < want.size() && i < got.size() && want[i] == got[i]) ++i;
  auto snippet = [&](const std::string& s) {
    const size_t b = i > 40 ? i - 40 : 0;
    return nlohmann::ordered_json(s.substr(b, 100)).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  };
  std::ostringstream os;
  os << "first difference at byte " << i << " (expected " << want.size() << " bytes, got " << got.size()
     << ")\n  expected: " << snippet(want) << "\n  got:      " << snippet(got);
  return os.str();
}

constexpr std::time_t kFixedNow = 1735689600;  // cases.json "now": strftime_now is pinned in both renderers

TEST(ChatTemplateReference, EveryPairMatchesJinja2) {
  const auto expected = render_reference();
  ASSERT_FALSE(expected.is_null());
  const auto manifest = read_json(kDataDir / "cases.json");
  ASSERT_EQ(manifest["now"].get<int64_t>(), int64_t(kFixedNow));

  std::map<std::string, ChatTemplate> templates;
  std::map<std::string, nlohmann::ordered_json> special_tokens;
  for (const auto& t : manifest["templates"]) {
    const std::string file = t["file"];
    templates.emplace(file, ChatTemplate::parse(read_text(kDataDir / "templates" / file)));
    special_tokens[file] = t.value("special_tokens", nlohmann::ordered_json::object());
  }

  int outputs = 0, outputs_matched = 0, errors = 0, errors_matched = 0;
  for (const auto& c : expected["cases"]) {
    const std::string tfile = c["template"], cfile = c["conversation"];
    const std::string name = tfile + " x " + cfile + (c["add_generation_prompt"].get<bool>() ? " +gen" : "");
    ChatRequest request = parse_chat_request(read_json(kDataDir / "conversations" / cfile));
    request.add_generation_prompt = c["add_generation_prompt"];
    const auto context = make_chat_context(request, special_tokens.at(tfile));
    ChatRenderOptions options;
    options.now = kFixedNow;
    if (c.contains("output")) {
      ++outputs;
      const std::string want = c["output"];
      try {
        const std::string got = templates.at(tfile).render(context, options);
        if (got == want) {
          ++outputs_matched;
        } else {
          ADD_FAILURE() << name << ": " << describe_difference(want, got);
        }
      } catch (const Error& e) {
        ADD_FAILURE() << name << ": Jinja2 renders it, tpmoe fails: " << e.what();
      }
    } else {
      ++errors;
      const std::string want = c["error"];
      try {
        const std::string got = templates.at(tfile).render(context, options);
        ADD_FAILURE() << name << ": Jinja2 fails (" << want << "), tpmoe renders " << got.size() << " bytes";
      } catch (const Error& e) {
        const std::string message = e.what();
        // raise_exception(msg): the template's own message must reach the user unchanged.
        const std::string prefix = "TemplateError: ";
        if (c["raised_by_template"].get<bool>() && message.find(want.substr(prefix.size())) == std::string::npos) {
          ADD_FAILURE() << name << ": expected the template's message '" << want << "', got: " << message;
        } else {
          ++errors_matched;
        }
      }
    }
  }
  std::printf("chat templates: %d/%d rendered outputs identical to Jinja2, %d/%d Jinja2 errors also errors here\n",
              outputs_matched, outputs, errors_matched, errors);
  EXPECT_EQ(outputs_matched, outputs);
  EXPECT_EQ(errors_matched, errors);
  // The suite must exercise real rendering, not only failures.
  EXPECT_GE(outputs, 300);
}

std::string render(const std::string& source,
                   const nlohmann::ordered_json& context = nlohmann::ordered_json::object()) {
  return ChatTemplate::parse(source).render(context);
}

// The message of the tpmoe::Error that `fn` throws ("" and a test failure when it throws none).
template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a tpmoe::Error";
  return "";
}

TEST(ChatTemplateErrors, SyntaxErrorsNameLineAndColumn) {
  auto msg = error_of([] { ChatTemplate::parse("line one\n{% if x %}\n  {{ 1 + }}\n{% endif %}"); });
  EXPECT_NE(msg.find("syntax error at line 3, column"), std::string::npos) << msg;
  msg = error_of([] { ChatTemplate::parse("{% for m in messages %}{{ m }}"); });
  EXPECT_NE(msg.find("'endfor' or 'else'"), std::string::npos) << msg;
  msg = error_of([] { ChatTemplate::parse("{{ 'unterminated }}"); });
  EXPECT_NE(msg.find("unterminated string"), std::string::npos) << msg;
  msg = error_of([] { ChatTemplate::parse("{{ x ]}}"); });
  EXPECT_NE(msg.find("line 1, column 6"), std::string::npos) << msg;
  msg = error_of([] { ChatTemplate::parse("{% endif %}"); });
  EXPECT_NE(msg.find("'endif'"), std::string::npos) << msg;
  msg = error_of([] { ChatTemplate::parse("{% frobnicate %}"); });
  EXPECT_NE(msg.find("unknown tag 'frobnicate'"), std::string::npos) << msg;
  msg = error_of([] { ChatTemplate::parse("{# never closed"); });
  EXPECT_NE(msg.find("comment"), std::string::npos) << msg;
  msg = error_of([] { ChatTemplate::parse("{{ x"); });
  EXPECT_NE(msg.find("expected '}}'"), std::string::npos) << msg;
  // Deep nesting is refused, not a stack overflow.
  msg = error_of([] { ChatTemplate::parse("{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}"); });
  EXPECT_NE(msg.find("nests deeper"), std::string::npos) << msg;
  std::string blocks;
  for (int i = 0; i < 5000; ++i) blocks += "{% if true %}";
  msg = error_of([&] { ChatTemplate::parse(blocks); });
  EXPECT_NE(msg.find("nests deeper"), std::string::npos) << msg;
}

TEST(ChatTemplateErrors, UnsupportedTagsSayWhat) {
  for (const char* tag : {"include 'x'", "import 'x' as y", "extends 'base'", "block body", "call m()"}) {
    const auto msg = error_of([&] { ChatTemplate::parse(std::string("{% ") + tag + " %}"); });
    EXPECT_NE(msg.find("not supported in chat templates"), std::string::npos) << msg;
  }
  const auto msg = error_of([] { ChatTemplate::parse("{% for x in y recursive %}{% endfor %}"); });
  EXPECT_NE(msg.find("recursive"), std::string::npos) << msg;
}

TEST(ChatTemplateErrors, RuntimeErrorsNameTheLine) {
  auto msg = error_of([] { render("a\nb\n{{ missing.attr }}"); });
  EXPECT_NE(msg.find("line 3"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'missing' is undefined"), std::string::npos) << msg;
  msg = error_of([] { render("{{ x | no_such_filter }}"); });
  EXPECT_NE(msg.find("no filter named 'no_such_filter'"), std::string::npos) << msg;
  msg = error_of([] { render("{{ 1 is no_such_test }}"); });
  EXPECT_NE(msg.find("no test named 'no_such_test'"), std::string::npos) << msg;
  msg = error_of([] { render("{{ 'a' + 1 }}"); });
  EXPECT_NE(msg.find("can only concatenate str"), std::string::npos) << msg;
  msg = error_of([] { render("{{ 1 < 'a' }}"); });
  EXPECT_NE(msg.find("'<' not supported"), std::string::npos) << msg;
  msg = error_of([] { render("{{ {'a': 1}.pop('a') }}"); });
  EXPECT_NE(msg.find("unsafe"), std::string::npos) << msg;
  msg = error_of([] { render("{% set x = 1 %}{% set x.y = 2 %}"); });
  EXPECT_NE(msg.find("non-namespace"), std::string::npos) << msg;
  msg = error_of([] { render("{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}"); });
  EXPECT_NE(msg.find("takes not more than 1 argument"), std::string::npos) << msg;
  msg = error_of([] { render("{{ 2 ** 100 }}"); });
  EXPECT_NE(msg.find("integer overflow"), std::string::npos) << msg;
  msg = error_of([] { render("{{ range(200000) | length }}"); });
  EXPECT_NE(msg.find("MAX_RANGE"), std::string::npos) << msg;
  msg = error_of([] { render("{{ 'x' * 1000000000000 }}"); });
  EXPECT_NE(msg.find("too large"), std::string::npos) << msg;
  msg = error_of([] {
    render("{% set ns = namespace(v=[]) %}{% for i in range(2000) %}{% set ns.v = [ns.v] %}{% endfor %}{{ ns.v }}");
  });
  EXPECT_NE(msg.find("maximum recursion depth"), std::string::npos) << msg;
  msg = error_of([] { render("{{ undefined_name | tojson }}"); });
  EXPECT_NE(msg.find("not JSON serializable"), std::string::npos) << msg;
}

TEST(ChatTemplateErrors, RaiseExceptionCarriesTheTemplatesMessage) {
  const auto msg = error_of([] { render("ok\n{{ raise_exception('bad role: ' ~ role) }}", {{"role", "robot"}}); });
  EXPECT_NE(msg.find("bad role: robot"), std::string::npos) << msg;
  EXPECT_NE(msg.find("line 2"), std::string::npos) << msg;
}

TEST(ChatTemplateErrors, RunawayRecursionIsAnErrorNotACrash) {
  const auto msg = error_of([] { render("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"); });
  EXPECT_NE(msg.find("maximum recursion depth"), std::string::npos) << msg;
}

TEST(ChatTemplateErrors, BadContextIsAnError) {
  const auto t = ChatTemplate::parse("{{ messages }}");
  EXPECT_NE(error_of([&] { t.render(nlohmann::ordered_json::array()); }).find("must be a JSON object"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_chat_request(nlohmann::ordered_json(3)); }).find("list of messages"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_chat_request(nlohmann::ordered_json::object()); }).find("no \"messages\""),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_chat_request(nlohmann::ordered_json::parse(R"([{"content": "x"}])")); }).find("role"),
            std::string::npos);
}

// Mutated templates (characters deleted, duplicated or replaced by template punctuation) must parse and
// render, or fail with a tpmoe::Error: never crash or hang.
TEST(ChatTemplateErrors, MutatedTemplatesNeverCrash) {
  const char* files[] = {"minimax_m2.jinja", "minimax_m3.jinja",    "qwen3.jinja",
                         "llama3_3.jinja",   "deepseek_v3_1.jinja", "features_expressions.jinja"};
  const auto conv = read_json(kDataDir / "conversations" / "parallel_tool_calls.json");
  const auto context = make_chat_context(parse_chat_request(conv), {{"bos_token", "<s>"}});
  const std::string alphabet = "{}%#-+|.,()[]'\"~ \nabsetifornd";
  std::mt19937 rng(1234);
  int rendered = 0, rejected = 0;
  for (const char* file : files) {
    const std::string source = read_text(kDataDir / "templates" / file);
    for (int iter = 0; iter < 300; ++iter) {
      std::string s = source;
      const int edits = 1 + int(rng() % 4);
      for (int k = 0; k < edits && !s.empty(); ++k) {
        const size_t pos = rng() % s.size();
        switch (rng() % 3) {
          case 0: s.erase(pos, 1 + rng() % 8); break;
          case 1: s.insert(pos, s.substr(pos, 1 + rng() % 8)); break;
          default: s[pos] = alphabet[rng() % alphabet.size()];
        }
      }
      try {
        ChatTemplate::parse(s).render(context);
        ++rendered;
      } catch (const Error&) {
        ++rejected;
      }
    }
  }
  std::printf("mutated templates: %d rendered, %d rejected with an error\n", rendered, rejected);
  EXPECT_GT(rendered, 0);
  EXPECT_GT(rejected, 0);
}

TEST(ChatTemplateLoad, FindsTheTemplateAndSpecialTokens) {
  const auto dir = test::make_temp_dir("chat_template_load");
  // tokenizer_config.json alone: a string template, tokens as strings, AddedToken objects and null.
  write_text(dir / "tokenizer_config.json", R"({
    "bos_token": {"__type": "AddedToken", "content": "<B>", "lstrip": false},
    "eos_token": "<E>",
    "pad_token": null,
    "model_max_length": 4096,
    "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}{{ pad_token is defined }}{{ eos_token }}"
  })");
  auto files = load_chat_template(dir);
  EXPECT_EQ(files.special_tokens, nlohmann::ordered_json::parse(R"({"bos_token": "<B>", "eos_token": "<E>"})"));
  EXPECT_EQ(files.origin, (dir / "tokenizer_config.json").string());
  ChatRequest request = parse_chat_request(nlohmann::ordered_json::parse(R"([{"role": "user", "content": "hi"}])"));
  EXPECT_EQ(apply_chat_template(dir, request), "<B>[user:hi]False<E>");

  // The list form picks "default" unless a name is given.
  write_text(dir / "tokenizer_config.json", R"({"chat_template": [
    {"name": "tool_use", "template": "T{{ messages | length }}"},
    {"name": "default", "template": "D{{ messages | length }}"}]})");
  EXPECT_EQ(apply_chat_template(dir, request), "D1");
  EXPECT_EQ(load_chat_template(dir, "tool_use").source, "T{{ messages | length }}");
  EXPECT_NE(error_of([&] {
              load_chat_template(dir, "nope");
            }).find("no chat template named 'nope' (have: tool_use, default)"),
            std::string::npos);

  // chat_template.jinja wins over tokenizer_config.json; the tokens still come from the config.
  write_text(dir / "tokenizer_config.json", R"({"eos_token": "</s>", "chat_template": "config"})");
  write_text(dir / "chat_template.jinja", "jinja {{ eos_token }} {{ add_generation_prompt }} {{ enable_thinking }}\n");
  request.add_generation_prompt = false;
  request.extra["enable_thinking"] = false;
  EXPECT_EQ(apply_chat_template(dir, request), "jinja </s> False False");

  // A broken template names its file.
  write_text(dir / "chat_template.jinja", "{% if %}");
  const auto msg = error_of([&] { apply_chat_template(dir, request); });
  EXPECT_NE(msg.find("chat_template.jinja"), std::string::npos) << msg;
  EXPECT_NE(msg.find("syntax error"), std::string::npos) << msg;
}

TEST(ChatTemplateLoad, MissingTemplateIsAnError) {
  const auto dir = test::make_temp_dir("chat_template_missing");
  write_text(dir / "tokenizer_config.json", R"({"eos_token": "</s>"})");
  const auto msg = error_of([&] { load_chat_template(dir); });
  EXPECT_NE(msg.find("no chat template"), std::string::npos) << msg;
  EXPECT_NE(msg.find(dir.string()), std::string::npos) << msg;
  write_text(dir / "tokenizer_config.json", "{not json");
  EXPECT_NE(error_of([&] { load_chat_template(dir); }).find("invalid JSON"), std::string::npos);
  EXPECT_NE(error_of([&] { load_chat_template(dir / "absent"); }).find("not a directory"), std::string::npos);
}

TEST(ChatTemplateContext, MatchesWhatHuggingFacePasses) {
  ChatRequest request = parse_chat_request(nlohmann::ordered_json::parse(
      R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}], "add_generation_prompt": false,
          "enable_thinking": true, "eos_token": "override"})"));
  const auto ctx = make_chat_context(request, {{"bos_token", "<s>"}, {"eos_token", "</s>"}});
  EXPECT_EQ(ctx.dump(), nlohmann::ordered_json::parse(R"({"messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function"}], "documents": null, "add_generation_prompt": false, "bos_token": "<s>",
      "eos_token": "override", "enable_thinking": true})")
                            .dump());
  // Without tools the template sees tools = None (defined, but none).
  const auto plain = make_chat_context(parse_chat_request(nlohmann::ordered_json::parse(R"([{"role": "user"}])")), {});
  EXPECT_EQ(render("{{ tools is defined }} {{ tools is none }} {{ add_generation_prompt }}", plain), "True True True");
}

}  // namespace
}  // namespace tpmoe::text
