// Chat templates: the DeepSeek-V3 template against jinja2's renderings of the reference
// conversations, byte for byte; the language pieces against jinja2 3.1.6 set up as transformers
// sets it up (every expected string below is jinja2's output); loading, errors and undefined.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "error_matchers.h"
#include "quantmla/chat_template.h"
#include "quantmla/error.h"
#include "quantmla/io.h"
#include "test_paths.h"

namespace quantmla {
namespace {

namespace fs = std::filesystem;
using ::quantmla::testing::bundled_model;
using ::quantmla::testing::error_message;
using ::quantmla::testing::expect_contains;
using ::quantmla::testing::shared_dir;

const nlohmann::ordered_json& reference() {
  static const nlohmann::ordered_json data = nlohmann::ordered_json::parse(
      read_text_file(shared_dir() / "reference" / "chat-template-reference.json"));
  return data;
}

// Renders `source` with the JSON object `context` (ordered, so dicts iterate as written).
std::string render(const std::string& source, const std::string& context = "{}") {
  return ChatTemplate(source).render(nlohmann::ordered_json::parse(context));
}

// The variables most cases render with.
constexpr const char* kData =
    R"({"xs": [1, 2, 3], "d": {"b": null, "a": 1}, "s": "Hi there", "msgs": [{"role": "system", "content": "S"}, {"role": "user", "content": " hi "}]})";

// A template, its context (JSON) and what jinja2 renders.
struct RenderCase {
  const char* name;
  const char* source;
  const char* context;
  const char* expected;
};

template <size_t N>
void expect_cases(const RenderCase (&cases)[N]) {
  for (const RenderCase& c : cases) {
    SCOPED_TRACE(c.name);
    EXPECT_EQ(render(c.source, c.context), c.expected) << c.source;
  }
}

// A scratch directory per test, for model directories with hand-made tokenizer_config.json files.
class ChatTemplateModelDir : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("quantmla-chat-template-" + std::to_string(::getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  void write(const std::string& name, const std::string& text) {
    std::ofstream(dir_ / name, std::ios::binary) << text;
  }
  fs::path dir_;
};

const RenderCase kWhitespaceControlCases[] = {
    {"trim_blocks drops the newline after a block tag", "{% if true %}\nA\n{% endif %}\nB", "{}",
     "A\nB"},
    {"lstrip_blocks strips indentation before a block tag",
     "a\n  {% if true %}\n    b\n  {% endif %}\nc", "{}", "a\n    b\nc"},
    {"lstrip_blocks leaves text before a tag on the same line", "x  {% if true %}y{% endif %}",
     "{}", "x  y"},
    {"variables are not lstripped", "  {{ 'v' }}\n", "{}", "  v"},
    {"minus markers strip all whitespace", "a \n {%- if true -%} \n b \n {%- endif -%} \n c", "{}",
     "abc"},
    {"print-tag minus markers", "a  {{- 'b' -}}  \n c", "{}", "abc"},
    {"plus markers keep whitespace", "  {%+ if true %}a{% endif +%}\nb", "{}", "  a\nb"},
    {"comments are dropped like blocks", "a {# note #}\n  {# indented -#}   b{#- x #} c", "{}",
     "a b c"},
    {"one trailing newline of the template goes", "x\n\n", "{}", "x\n"},
    {"CRLF reads as LF", "a\r\n{% if true %}\r\nb\r\n{% endif %}\r\n", "{}", "a\nb\n"},
};

const RenderCase kLoopsCases[] = {
    {"loop variables",
     "{% for k, v in d.items() %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.first "
     "}}{{ loop.last }}{{ loop.length }}{{ k }}={{ v }};{% endfor %}",
     kData, "102TrueFalse2b=None;211FalseTrue2a=1;"},
    {"previtem, nextitem and cycle",
     "{% for x in xs %}{{ loop.previtem }}<{{ x }}>{{ loop.nextitem }} {{ loop.cycle('odd', "
     "'even') }}|{% endfor %}",
     kData, "<1>2 odd|1<2>3 even|2<3> odd|"},
    {"else runs for an empty loop", "{% for x in [] %}item{% else %}none{% endfor %}", "{}",
     "none"},
    {"an if filter counts only what passes",
     "{% for x in xs if x > 1 %}{{ loop.index }}/{{ loop.length }}={{ x }} {% endfor %}", kData,
     "1/2=2 2/2=3 "},
    {"break and continue",
     "{% for x in range(10) %}{% if x % 2 %}{% continue %}{% endif %}{% if x > 6 %}{% break %}{% "
     "endif %}{{ x }}{% endfor %}",
     "{}", "0246"},
    {"nested loops each have their own loop",
     "{% for a in [[1, 2], [3]] %}{% for b in a %}{{ loop.index }}{{ b }} {% endfor %}{{ "
     "loop.index }};{% endfor %}",
     "{}", "11 22 1;13 2;"},
    {"a dict iterates over its keys in order", "{% for k in d %}{{ k }}{% endfor %}", kData, "ba"},
    {"a string iterates over characters", "{% for c in 'Grüß' %}[{{ c }}]{% endfor %}", "{}",
     "[G][r][ü][ß]"},
};

const RenderCase kScopingCases[] = {
    {"a set in a loop does not outlive the iteration",
     "{% set x = 10 %}{% for i in range(3) %}{{ x }}{% set x = x + i %}{{ x }},{% endfor %}{{ x }}",
     "{}", "1010,1011,1012,10"},
    {"a set in an if stays", "{% if true %}{% set y = 1 %}{% endif %}{{ y }}", "{}", "1"},
    {"a namespace is shared",
     "{% set ns = namespace(total=0, seen='') %}{% for x in xs %}{% set ns.total = ns.total + x "
     "%}{% set ns.seen = ns.seen ~ x %}{% endfor %}{{ ns.total }} {{ ns.seen }}",
     kData, "6 123"},
    {"a loop before a later top-level set sees it undefined",
     "{% for i in [1] %}[{{ x }}]{% endfor %}{% set x = 's' %}[{{ x }}]", R"({"x": "context"})",
     "[][s]"},
    {"a top-level read before the set sees the context", "[{{ x }}]{% set x = 's' %}[{{ x }}]",
     R"({"x": "context"})", "[context][s]"},
    {"set unpacks a sequence", "{% set a, b = [1, 2] %}{{ b }}{{ a }}", "{}", "21"},
    {"a set block captures its body", "{% set t %}<{{ 1 + 1 }}>{% endset %}[{{ t }}]", "{}",
     "[<2>]"},
    {"macros with defaults and keywords",
     "{% macro tag(name, body='') %}<{{ name }}>{{ body }}</{{ name }}>{% endmacro %}{{ tag('a') "
     "}}{{ tag('b', 'x') }}{{ tag(body='y', name='c') }}",
     "{}", "<a></a><b>x</b><c>y</c>"},
};

const RenderCase kExpressionsCases[] = {
    {"literals render as Python prints them",
     R"({{ 1 }} {{ 1.5 }} {{ 1.0 }} {{ 1e16 }} {{ 1e-5 }} {{ none }} {{ True }} {{ false }} {{ [1, 'a', none] }} {{ {'k': (1,)} }} {{ "it's" }})",
     "{}", "1 1.5 1.0 1e+16 1e-05 None True False [1, 'a', None] {'k': (1,)} it's"},
    {"string escapes", R"({{ 'tab\tq\'\\' }}|{{ "\u00e9\x41" }}|{{ 'a' 'b' }})", "{}",
     "tab\tq'\\|éA|ab"},
    {"arithmetic follows Python",
     "{{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 4 / 2 }} {{ 2 ** 10 }} {{ 0.1 + 0.2 "
     "}} {{ true + 1 }} {{ 'ab' * 2 }} {{ [1] + [2] }}",
     "{}", "3 -4 2 3.5 2.0 1024 0.30000000000000004 2 abab [1, 2]"},
    {"~ concatenates as strings", "{{ 'n=' ~ 1 ~ none ~ undefined_name ~ [2] }}", "{}",
     "n=1None[2]"},
    {"comparisons, chains and in",
     "{{ 1 == 1.0 }} {{ 'a' < 'b' }} {{ 1 < 2 < 2 }} {{ 2 in xs }} {{ 'a' not in d }} {{ 'er' in s "
     "}} {{ 'a' == none }}",
     kData, "True True False True False True False"},
    {"and/or give an operand",
     "{{ xs and 'yes' }}|{{ '' or 'fallback' }}|{{ '' and 'x' }}|{{ not xs }}", kData,
     "yes|fallback||False"},
    {"conditional expressions",
     "{{ 'a' if xs else 'b' }}{{ 'c' if [] else 'd' }}[{{ 'e' if false }}]", kData, "ad[]"},
    {"attributes, subscripts and methods",
     "{{ d.a }}{{ d['a'] }}{{ xs[0] }}{{ xs[-1] }}{{ xs.1 }}{{ d.get('zz', 'dflt') }}{{ d.get('b') "
     "}}{{ d.keys() | list }}",
     kData, "11132dfltNone['b', 'a']"},
    {"missing keys and indexes are undefined", "[{{ d.zz }}][{{ xs[10] }}][{{ d.zz is defined }}]",
     kData, "[][][False]"},
    {"slices",
     "{{ 'abcdef'[1:3] }} {{ 'abc'[::-1] }} {{ xs[1:] }} {{ xs[:-1] }} {{ xs[::2] }} {{ "
     "'Grüße'[-2:] }}",
     kData, "bc cba [2, 3] [1, 2] [1, 3] ße"},
    {"string methods",
     "{{ '  x  '.strip() }}|{{ 'xxhixx'.strip('x') }}|{{ ' a '.lstrip() }}|{{ ' a '.rstrip() }}|{{ "
     "'a,b,,c'.split(',') }}|{{ ' a  b '.split() }}|{{ 'a b c'.split(' ', 1) }}|{{ "
     "s.startswith('Hi') }}{{ s.endswith(('x', 're')) }}|{{ s.replace('e', 'E') }}|{{ s.upper() "
     "}}{{ s.lower() }}{{ 'ab cd'.title() }}|{{ 'a</think>b'.split('</think>')[-1] }}",
     kData,
     "x|hi|a | a|['a', 'b', '', 'c']|['a', 'b']|['a', 'b c']|TrueTrue|Hi thErE|HI THEREhi thereAb "
     "Cd|b"},
};

const RenderCase kFiltersCases[] = {
    {"length, first, last, list, join",
     "{{ xs | length }}{{ 'Grüße' | length }}{{ d | length }}{{ xs | first }}{{ xs | last }}{{ "
     "'ab' | list }}{{ xs | join(', ') }}{{ msgs | map(attribute='role') | join('/') }}",
     kData, "35213['a', 'b']1, 2, 3system/user"},
    {"trim, upper, lower, replace, string, title",
     R"([{{ '  t \n' | trim }}]{{ s | upper }}{{ s | lower }}{{ s | replace('Hi', 'Yo') }}{{ 12 | string }}{{ 'hello world' | title }})",
     kData, "[t]HI THEREhi thereYo there12Hello World"},
    {"default",
     "{{ missing | default('a') }}{{ '' | default('b') }}{{ '' | default('c', true) }}{{ none | "
     "default('d') }}",
     "{}", "acNone"},
    {"items, dictsort, sort, unique, reverse, sum",
     "{{ d | items | list }}{{ d | dictsort }}{{ [3, 1, 2] | sort }}{{ ['b', 'A', 'c'] | sort }}{{ "
     "[1, 2, 1] | unique | list }}{{ xs | reverse | list }}{{ xs | sum }}",
     kData,
     "[('b', None), ('a', 1)][('a', 1), ('b', None)][1, 2, 3]['A', 'b', 'c'][1, 2][3, 2, 1]6"},
    {"select, reject, selectattr, rejectattr",
     "{{ xs | select('odd') | list }}{{ xs | reject('odd') | list }}{{ msgs | selectattr('role', "
     "'equalto', 'user') | map(attribute='content') | list }}{{ msgs | rejectattr('role', 'eq', "
     "'user') | map(attribute='content') | list }}",
     kData, "[1, 3][2][' hi ']['S']"},
    {"int, float, round, abs",
     "{{ '42' | int }}{{ '4.7' | int }}{{ 'x' | int(7) }}{{ '2.5' | float }}{{ 3.14159 | round(2) "
     "}}{{ 2.5 | round }}{{ -3 | abs }}",
     "{}", "42472.53.142.03"},
    {"tojson as transformers defines it",
     R"({{ d | tojson }}|{{ 'é\n"<>' | tojson }}|{{ 'é' | tojson(ensure_ascii=true) }}|{{ d | tojson(indent=2) }}|{{ d | tojson(separators=(',', ':')) }}|{{ d | tojson(sort_keys=true) }}|{{ [1.5, true, none, [], {}] | tojson }})",
     kData,
     "{\"b\": null, \"a\": 1}|\"é\\n\\\"<>\"|\"\\u00e9\"|{\n  \"b\": null,\n  \"a\": "
     "1\n}|{\"b\":null,\"a\":1}|{\"a\": 1, \"b\": null}|[1.5, true, null, [], {}]"},
    {"indent", R"({{ 'a\nb\n\nc' | indent(2) }}|{{ 'a\nb' | indent(2, true) }})", "{}",
     "a\n  b\n\n  c|  a\n  b"},
};

const RenderCase kTestsCases[] = {
    {"type tests",
     "{{ xs is iterable }}{{ d is mapping }}{{ s is string }}{{ 1 is number }}{{ 1.5 is float }}{{ "
     "1 is integer }}{{ true is integer }}{{ true is boolean }}{{ none is none }}{{ d is sequence "
     "}}",
     kData, "TrueTrueTrueTrueTrueTrueFalseTrueTrueTrue"},
    {"defined, none and negation",
     "{{ missing is defined }}{{ missing is not defined }}{{ none is not none }}{{ xs is not none "
     "}}",
     kData, "FalseTrueFalseTrue"},
    {"value tests",
     "{{ 3 is odd }}{{ 4 is even }}{{ 9 is divisibleby 3 }}{{ 2 is in xs }}{{ true is true }}{{ 1 "
     "is true }}{{ false is false }}{{ 'ab' is lower }}{{ 1 is eq 1 }}{{ 3 is gt 2 }}",
     kData, "TrueTrueTrueTrueTrueFalseTrueTrueTrueTrue"},
};

// DeepSeek-V2's chat template.
const char* const kDeepSeekV2Template =
    R"tpl({% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\n\n' }}{% elif message['role'] == 'assistant' %}{{ 'Assistant: ' + message['content'] + eos_token }}{% elif message['role'] == 'system' %}{{ message['content'] + '\n\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %})tpl";

// A template in the style of Kimi K2's: a macro, tools as compact JSON, tool calls with object
// arguments, `is string`, dict .get and `in` on dicts, with indentation the markers strip.
const char* const kKimiStyleTemplate = R"tpl({%- macro render_content(msg) -%}
    {%- set c = msg.get('content') -%}
    {%- if c is string -%}
      {{ c }}
    {%- elif c is not none -%}
      {% for content in c -%}
        {% if content['type'] == 'image' or 'image' in content or 'image_url' in content -%}
          <|media_start|>image<|media_content|><|media_pad|><|media_end|>
        {% else -%}
          {{ content['text'] }}
        {%- endif -%}
      {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}

{%- if tools -%}
  <|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>
{%- endif -%}
{% for message in messages %}
  {%- if loop.first and messages[0]['role'] != 'system' -%}
  <|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>
  {% endif %}
  {%- set role_name =  message.get('name') or  message['role'] -%}
  {%- if message['role'] == 'user' -%}
    <|im_user|>{{role_name}}<|im_middle|>
  {%- elif message['role'] == 'assistant' -%}
    <|im_assistant|>{{role_name}}<|im_middle|>
  {%- else -%}
    <|im_system|>{{role_name}}<|im_middle|>
  {%- endif -%}

  {%- if message['role'] == 'assistant' and message.get('tool_calls') -%}
    {{render_content(message)}}<|tool_calls_section_begin|>
    {%- for tool_call in message['tool_calls'] -%}
      {%- set formatted_id = tool_call['id'] -%}
      <|tool_call_begin|>{{ formatted_id }}<|tool_call_argument_begin|>{% if tool_call['function']['arguments'] is string %}{{ tool_call['function']['arguments'] }}{% else %}{{ tool_call['function']['arguments'] | tojson }}{% endif %}<|tool_call_end|>
    {%- endfor -%}
    <|tool_calls_section_end|>
  {%- elif message['role'] == 'tool' -%}
    ## Return of {{ message.tool_call_id }}
{{render_content(message)}}
  {%- elif message['content'] is not none -%}
    {{render_content(message)}}
  {%- endif -%}
  <|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}
  <|im_assistant|>assistant<|im_middle|>
{%- endif -%}
)tpl";

TEST(ChatTemplateReference, DeepSeekV3RendersEveryCaseByteIdentically) {
  const std::optional<ChatTemplate> chat_template =
      ChatTemplate::from_model_dir(shared_dir() / "tokenizers" / "deepseek-v3");
  ASSERT_TRUE(chat_template.has_value());
  const std::string bos = reference()["bos_token"];
  const std::string eos = reference()["eos_token"];
  ASSERT_EQ(reference()["cases"].size(), 9u);
  for (const auto& c : reference()["cases"]) {
    SCOPED_TRACE(c["name"].get<std::string>());
    EXPECT_EQ(
        apply_chat_template(*chat_template, c["messages"], c["add_generation_prompt"], bos, eos),
        c["rendered"].get<std::string>());
  }
}

TEST(ChatTemplateReference, SpecialTokensComeFromTokenizerConfig) {
  // DeepSeek-V3 spells them as AddedToken objects; mla-tiny as plain strings.
  const ChatSpecialTokens deepseek =
      read_chat_special_tokens(shared_dir() / "tokenizers" / "deepseek-v3");
  EXPECT_EQ(deepseek.bos_token, reference()["bos_token"].get<std::string>());
  EXPECT_EQ(deepseek.eos_token, reference()["eos_token"].get<std::string>());
  const ChatSpecialTokens tiny = read_chat_special_tokens(bundled_model());
  EXPECT_EQ(tiny.bos_token, "<|begin_of_text|>");
  EXPECT_EQ(tiny.eos_token, "<|end_of_text|>");
}

TEST(ChatTemplateWhitespace, TrimBlocksLstripBlocksAndMarkers) {
  expect_cases(kWhitespaceControlCases);
}

TEST(ChatTemplateStatements, Loops) { expect_cases(kLoopsCases); }

TEST(ChatTemplateStatements, ScopingSetNamespaceAndMacros) { expect_cases(kScopingCases); }

TEST(ChatTemplateExpressions, LiteralsOperatorsLookupsAndSlices) {
  expect_cases(kExpressionsCases);
}

TEST(ChatTemplateExpressions, Filters) { expect_cases(kFiltersCases); }

TEST(ChatTemplateExpressions, Tests) { expect_cases(kTestsCases); }

TEST(ChatTemplateUndefined, BehavesAsJinja2Undefined) {
  EXPECT_EQ(render("[{{ missing }}]"), "[]");
  EXPECT_EQ(render("{{ missing is defined }}{{ missing is undefined }}{{ not missing }}"),
            "FalseTrueTrue");
  EXPECT_EQ(render("{% if missing %}yes{% else %}no{% endif %}"), "no");
  EXPECT_EQ(
      render("{{ missing | length }}{% for x in missing %}x{% endfor %}{{ missing == nope }}"),
      "0True");
  EXPECT_EQ(render("{{ missing | default('d') }}{{ 'a' ~ missing ~ 'b' }}"), "dab");
  // Looking into it, or computing with it, raises as jinja2's default Undefined does.
  expect_contains(error_message<InvalidArgument>([] { render("{{ missing.field }}"); }),
                  {"'missing' is undefined", "line 1"});
  expect_contains(error_message<InvalidArgument>([] { render("{{ missing + 1 }}"); }),
                  {"'missing' is undefined"});
  expect_contains(error_message<InvalidArgument>([] { render("{{ d.nope.x }}", R"({"d": {}})"); }),
                  {"'dict object' has no attribute 'nope'"});
}

TEST(ChatTemplateErrors, MalformedTemplatesNameLineColumnAndExpectation) {
  const auto syntax_error = [](const std::string& source) {
    return error_message<FormatError>([&] { ChatTemplate{source}; });
  };
  expect_contains(syntax_error("hello\n{% if %}"),
                  {"line 2, column 7", "expected an expression", "end of statement block"});
  expect_contains(
      syntax_error("{% if x %}\nopen"),
      {"line 2, column 5", "unexpected end of template", "'endif'", "'if' at line 1, column 1"});
  expect_contains(syntax_error("{{ a.b( }}"), {"line 1, column 9", "unexpected '}'", "')'"});
  expect_contains(syntax_error("ab\n  {{ 'x' ) }}"), {"line 2, column 10", "unexpected ')'"});
  expect_contains(syntax_error("{{ 'open }}"), {"line 1, column 4", "unterminated string"});
  expect_contains(syntax_error("{% endfor %}"), {"line 1, column 4", "'endfor'"});
  expect_contains(syntax_error("{{ x | nosuchfilter }}"), {"no filter named 'nosuchfilter'"});
  expect_contains(syntax_error("{{ x is nosuchtest }}"), {"no test named 'nosuchtest'"});
  expect_contains(syntax_error("{% break %}"), {"'break' outside of a for loop"});
  expect_contains(syntax_error("{# never closed"), {"line 1, column 1", "comment"});
  expect_contains(syntax_error("{{ 1 2 }}"), {"expected end of print statement, got integer"});
  expect_contains(syntax_error(std::string("bad \xff byte")), {"not valid UTF-8", "byte 4"});
}

TEST(ChatTemplateErrors, RaiseExceptionThrowsInvalidArgumentWithTheMessage) {
  const ChatTemplate chat_template(
      "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation roles must "
      "alternate user/assistant/user/assistant/...') }}{% endif %}ok");
  const auto context = nlohmann::json::parse(R"({"messages": [{"role": "assistant"}]})");
  EXPECT_EQ(error_message<InvalidArgument>([&] { chat_template.render(context); }),
            "Conversation roles must alternate user/assistant/user/assistant/...");
}

TEST(ChatTemplateErrors, RuntimeErrorsNameThePosition) {
  expect_contains(error_message<InvalidArgument>([] { render("x\n{{ 'a' + 1 }}"); }),
                  {"line 2, column 8", "can only concatenate str (not \"int\") to str"});
  expect_contains(error_message<InvalidArgument>([] { render("{% for x in 5 %}{% endfor %}"); }),
                  {"line 1, column 1", "'int' object is not iterable"});
  expect_contains(error_message<InvalidArgument>([] { render("{{ 1 < 'a' }}"); }),
                  {"'<' not supported between instances of 'int' and 'str'"});
  expect_contains(error_message<InvalidArgument>([] { render("{{ [1].append(2) }}"); }),
                  {"'append'", "unsafe"});
  expect_contains(
      error_message<InvalidArgument>([] { render("{% set x = 1 %}{% set x.y = 2 %}"); }),
      {"cannot assign attribute on non-namespace object"});
  expect_contains(error_message<InvalidArgument>([] { render("{{ missing | tojson }}"); }),
                  {"Object of type Undefined is not JSON serializable"});
  expect_contains(error_message<InvalidArgument>(
                      [] { render("{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}"); }),
                  {"RecursionError"});
  // Repetition past any prompt is refused at once, not built (found by fuzz_chat_template: the
  // renderer spent seconds and gigabytes on a string times 10^14).
  expect_contains(error_message<InvalidArgument>([] { render("{{ 111111111111118 * '}' }}"); }),
                  {"MemoryError", "a string of 111111111111118"});
  expect_contains(error_message<InvalidArgument>([] { render("{{ [1, 2] * 10000000 }}"); }),
                  {"MemoryError", "a list of 20000000"});
  for (const char* filter : {"indent(1000000000000000)", "tojson(indent=1000000000000000)"}) {
    expect_contains(
        error_message<InvalidArgument>([&] { render(std::string("{{ [1] | ") + filter + " }}"); }),
        {"MemoryError"});
  }
  // Nesting: a context, or a value a template builds, nested past Value::kMaxNesting is refused
  // (Python's RecursionError), not walked until the stack runs out.
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  const auto deep_json = nlohmann::json::parse(deep);
  expect_contains(error_message<InvalidArgument>([&] {
                    nlohmann::json context = nlohmann::json::object();  // moved in, not copied
                    context.emplace("x", nlohmann::json::parse(deep));
                    ChatTemplate("{{ x }}").render(context);
                  }),
                  {"RecursionError", "deeper than 512"});
  expect_contains(error_message<InvalidArgument>([] {
                    render(
                        "{% set ns = namespace(x=[]) %}{% for i in range(600) %}"
                        "{% set ns.x = [ns.x] %}{% endfor %}{{ ns.x }}");
                  }),
                  {"RecursionError", "nested deeper than 512"});
  EXPECT_EQ(render("{% set ns = namespace(x=[]) %}{% for i in range(3) %}{% set ns.x = [ns.x] "
                   "%}{% endfor %}{{ ns.x }}"),
            "[[[[]]]]");
  expect_contains(error_message<InvalidArgument>([&] {
                    apply_chat_template(ChatTemplate("{{ messages }}"), deep_json, true, "", "");
                  }),
                  {"chat messages nest deeper than"});
  // Printing a value whose text would pass the limit (the fuzzer's third timeout: a conversation
  // repeated 420,000 times, printed).
  expect_contains(
      error_message<InvalidArgument>([] { render("{{ [{'a': 'x' * 1000}] * 20000 }}"); }),
      {"MemoryError", "at most 16777216"});
  // Doubling in a loop stops at the same limit, by + and by ~.
  for (const char* op : {"+", "~"}) {
    expect_contains(error_message<InvalidArgument>([&] {
                      render(std::string("{% set ns = namespace(s='ab') %}{% for i in range(64) %}"
                                         "{% set ns.s = ns.s ") +
                             op + " ns.s %}{% endfor %}");
                    }),
                    {"MemoryError", "at most 16777216"});
  }
  EXPECT_EQ(render("{{ 'ab' * 3 }}{{ 'x' * -2 }}{{ [1] * 2 }}"), "ababab[1, 1]");
  // An empty sequence repeated any number of times is empty at once (a loop of 8 * 10^8 empty
  // appends was the fuzzer's second timeout).
  EXPECT_EQ(render("{{ ([] * 802000000) | length }}{{ '' * 9000000000000000000 }}"), "0");
}

TEST(ChatTemplateContext, JsonKeyOrderAndTransformersVariables) {
  const ChatTemplate chat_template("{{ d | tojson }}");
  // ordered_json keeps the caller's order, as a Python dict would; nlohmann::json sorts.
  EXPECT_EQ(chat_template.render(nlohmann::ordered_json::parse(R"({"d": {"b": 1, "a": 2}})")),
            R"({"b": 1, "a": 2})");
  EXPECT_EQ(chat_template.render(nlohmann::json::parse(R"({"d": {"b": 1, "a": 2}})")),
            R"({"a": 2, "b": 1})");
  expect_contains(
      error_message<InvalidArgument>([&] { chat_template.render(nlohmann::json::parse("[1]")); }),
      {"must be a JSON object", "array"});
  // apply_chat_template passes tools and documents as None, as transformers does.
  const ChatTemplate probe(
      "{{ messages | length }} {{ add_generation_prompt }} {{ bos_token }}{{ eos_token }} "
      "{{ tools is none }} {{ documents is defined }}");
  EXPECT_EQ(apply_chat_template(probe, nlohmann::json::parse(R"([{"role": "user"}])"), true, "<s>",
                                "</s>"),
            "1 True <s></s> True True");
  // Tools given: the template sees the list, in the caller's key order; not a list: refused.
  const ChatTemplate tools_probe("{% if tools %}{{ tools | tojson }}{% endif %}");
  const auto user = nlohmann::ordered_json::parse(R"([{"role": "user"}])");
  EXPECT_EQ(apply_chat_template(tools_probe, user, true, "", "",
                                nlohmann::ordered_json::parse(
                                    R"([{"type": "function", "function": {"name": "now"}}])")),
            R"([{"type": "function", "function": {"name": "now"}}])");
  expect_contains(error_message<InvalidArgument>([&] {
                    apply_chat_template(tools_probe, user, true, "", "",
                                        nlohmann::ordered_json("now"));
                  }),
                  {"tools must be a JSON array or null", "string"});
}

TEST(ChatTemplateStyles, DeepSeekV2Template) {
  const ChatTemplate chat_template(kDeepSeekV2Template);
  const auto messages = nlohmann::ordered_json::parse(
      R"([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "2+2?"}])");
  EXPECT_EQ(apply_chat_template(chat_template, messages, true, "<bos>", "<eos>"),
            "<bos>Be brief.\n\nUser: Hi\n\nAssistant: Hello<eos>User: 2+2?\n\nAssistant:");
}

TEST(ChatTemplateStyles, KimiStyleTemplateWithMacroToolsAndToolCalls) {
  const ChatTemplate chat_template(kKimiStyleTemplate);
  const auto messages = nlohmann::ordered_json::parse(R"([
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "functions.get_weather:0",
      "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "11 °C"}])");
  nlohmann::ordered_json context = {
      {"messages", messages}, {"add_generation_prompt", true}, {"documents", nullptr}};
  context["tools"] = nlohmann::ordered_json::parse(
      R"([{"type": "function", "function": {"name": "get_weather", "parameters": {"type":
          "object", "properties": {"city": {"type": "string"}}}}}])");
  EXPECT_EQ(chat_template.render(context),
            "<|im_system|>tool_declare<|im_middle|>[{\"type\":\"function\",\"function\":{\"name\":"
            "\"get_weather\",\"parameters\":{\"type\":\"object\",\"properties\":{\"city\":{"
            "\"type\":\"string\"}}}}}]<|im_end|><|im_system|>system<|im_middle|>You are Kimi, an "
            "AI assistant created by Moonshot "
            "AI.<|im_end|>\n<|im_user|>user<|im_middle|>Weather?<|im_end|><|im_assistant|>"
            "assistant<|im_middle|><|tool_calls_section_begin|><|tool_call_begin|>functions.get_"
            "weather:0<|tool_call_argument_begin|>{\"city\": "
            "\"Paris\"}<|tool_call_end|><|tool_calls_section_end|><|im_end|><|im_system|>tool<|im_"
            "middle|>## Return of functions.get_weather:0\n11 "
            "°C<|im_end|><|im_assistant|>assistant<|im_middle|>");
}

TEST_F(ChatTemplateModelDir, ModelWithoutATemplateHasNone) {
  EXPECT_FALSE(ChatTemplate::from_model_dir(bundled_model()).has_value());  // mla-tiny
  EXPECT_FALSE(ChatTemplate::from_model_dir(dir_).has_value());  // no tokenizer_config.json
  write("tokenizer_config.json", R"({"bos_token": "<s>", "chat_template": null})");
  EXPECT_FALSE(ChatTemplate::from_model_dir(dir_).has_value());
}

TEST_F(ChatTemplateModelDir, NamedTemplatesPickTheDefault) {
  write("tokenizer_config.json", R"({"chat_template": [
      {"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]})");
  EXPECT_EQ(ChatTemplate::from_model_dir(dir_)->render(nlohmann::json::object()), "plain");
  write("tokenizer_config.json", R"({"chat_template": [{"name": "rag", "template": "x"}]})");
  expect_contains(error_message<FormatError>([&] { ChatTemplate::from_model_dir(dir_); }),
                  {"tokenizer_config.json", "'rag'", "none named 'default'"});
}

TEST_F(ChatTemplateModelDir, ChatTemplateJinjaFileComesFirst) {
  write("tokenizer_config.json", R"({"chat_template": "from config"})");
  write("chat_template.jinja", "from jinja file\n");
  EXPECT_EQ(ChatTemplate::from_model_dir(dir_)->render(nlohmann::json::object()),
            "from jinja file");
}

TEST_F(ChatTemplateModelDir, MalformedFilesAreFormatErrors) {
  write("tokenizer_config.json", R"({"chat_template": )");
  expect_contains(error_message<FormatError>([&] { ChatTemplate::from_model_dir(dir_); }),
                  {"tokenizer_config.json"});
  write("tokenizer_config.json", R"({"chat_template": 42})");
  expect_contains(error_message<FormatError>([&] { ChatTemplate::from_model_dir(dir_); }),
                  {"chat_template must be a string", "number"});
  write("tokenizer_config.json", R"({"chat_template": "line one\n{% if %}"})");
  expect_contains(error_message<FormatError>([&] { ChatTemplate::from_model_dir(dir_); }),
                  {"tokenizer_config.json", "line 2, column 7"});
  write("tokenizer_config.json", R"({"bos_token": 7})");
  expect_contains(error_message<FormatError>([&] { read_chat_special_tokens(dir_); }),
                  {"bos_token", "7"});
}

TEST_F(ChatTemplateModelDir, FromFileReadsJinjaOrAJsonChatTemplate) {
  write("t.jinja", "{{ 'raw' }}\n");
  write("t.json", R"({"chat_template": "{{ 'json' }}"})");
  write("empty.json", R"({"bos_token": "<s>"})");
  EXPECT_EQ(ChatTemplate::from_file(dir_ / "t.jinja").render(nlohmann::json::object()), "raw");
  EXPECT_EQ(ChatTemplate::from_file(dir_ / "t.json").render(nlohmann::json::object()), "json");
  expect_contains(error_message<FormatError>([&] { ChatTemplate::from_file(dir_ / "empty.json"); }),
                  {"empty.json has no chat_template"});
  expect_contains(error_message<IoError>([&] { ChatTemplate::from_file(dir_ / "absent.jinja"); }),
                  {"absent.jinja"});
}

}  // namespace
}  // namespace quantmla
