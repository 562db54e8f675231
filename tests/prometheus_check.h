// Reads Prometheus' text exposition format (version 0.0.4) back, strictly enough for the serving
// tests: every sample line parses, every metric family has HELP and TYPE lines before its samples,
// and every histogram's buckets rise with `le`, end at +Inf and agree with _count.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace tpmoe::test {

struct PromSample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

struct PromExposition {
  std::map<std::string, std::string> help, type;  // by family
  std::vector<PromSample> samples;

  // The value of the one sample named `name` with `labels`; nullopt when absent.
  std::optional<double> value(const std::string& name, const std::map<std::string, std::string>& labels = {}) const {
    for (const auto& s : samples)
      if (s.name == name && s.labels == labels) return s.value;
    return std::nullopt;
  }
};

inline double parse_prom_value(const std::string& v) {
  if (v == "+Inf") return INFINITY;
  if (v == "-Inf") return -INFINITY;
  if (v == "NaN") return NAN;
  char* end = nullptr;
  const double d = std::strtod(v.c_str(), &end);
  EXPECT_TRUE(end && *end == '\0' && !v.empty()) << "not a number: '" << v << "'";
  return d;
}

// The family a sample belongs to: a histogram's _bucket/_sum/_count lines belong to the histogram.
inline std::string prom_family(const PromExposition& e, const std::string& name) {
  for (const char* suffix : {"_bucket", "_sum", "_count"}) {
    const std::string s = suffix;
    if (name.size() > s.size() && name.ends_with(s)) {
      const std::string base = name.substr(0, name.size() - s.size());
      if (auto it = e.type.find(base); it != e.type.end() && it->second == "histogram") return base;
    }
  }
  return name;
}

// Parses and checks `text`; failures are reported through gtest.
inline PromExposition parse_prometheus(const std::string& text) {
  PromExposition e;
  EXPECT_TRUE(text.empty() || text.back() == '\n') << "the exposition must end with a newline";
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (line.empty()) continue;
    if (line.starts_with("# HELP ") || line.starts_with("# TYPE ")) {
      const std::string rest = line.substr(7);
      const size_t space = rest.find(' ');
      EXPECT_NE(space, std::string::npos) << line;
      if (space == std::string::npos) continue;
      const std::string family = rest.substr(0, space), what = rest.substr(space + 1);
      if (line[2] == 'H') {
        EXPECT_FALSE(e.help.count(family)) << "second HELP for " << family;
        e.help[family] = what;
      } else {
        EXPECT_TRUE(what == "counter" || what == "gauge" || what == "histogram" || what == "summary" ||
                    what == "untyped")
            << line;
        EXPECT_FALSE(e.type.count(family)) << "second TYPE for " << family;
        e.type[family] = what;
      }
      continue;
    }
    EXPECT_NE(line[0], '#') << "unknown comment: " << line;
    PromSample s;
    size_t i = 0;
    while (i < line.size() && (std::isalnum(static_cast<unsigned char>(line[i])) || line[i] == '_' || line[i] == ':'))
      ++i;
    s.name = line.substr(0, i);
    EXPECT_FALSE(s.name.empty() || std::isdigit(static_cast<unsigned char>(s.name[0]))) << "bad name: " << line;
    if (i < line.size() && line[i] == '{') {
      const size_t close = line.find('}', i);
      EXPECT_NE(close, std::string::npos) << line;
      std::string labels = line.substr(i + 1, close - i - 1);
      while (!labels.empty()) {
        const size_t eq = labels.find("=\"");
        const size_t end = labels.find('"', eq + 2);
        EXPECT_TRUE(eq != std::string::npos && end != std::string::npos) << "bad labels: " << line;
        if (eq == std::string::npos || end == std::string::npos) break;
        s.labels[labels.substr(0, eq)] = labels.substr(eq + 2, end - eq - 2);
        labels.erase(0, end + 1);
        if (!labels.empty() && labels[0] == ',') labels.erase(0, 1);
      }
      i = close + 1;
    }
    EXPECT_TRUE(i < line.size() && line[i] == ' ') << "no value: " << line;
    s.value = parse_prom_value(line.substr(i + 1));
    const std::string family = prom_family(e, s.name);
    EXPECT_TRUE(e.type.count(family) && e.help.count(family)) << "no HELP/TYPE before " << line;
    e.samples.push_back(std::move(s));
  }
  // Histograms: le rising, counts non-decreasing, +Inf last and equal to _count.
  for (const auto& [family, type] : e.type) {
    if (type != "histogram") continue;
    double last_le = -INFINITY, last_count = 0;
    int buckets = 0;
    for (const auto& s : e.samples) {
      if (s.name != family + "_bucket") continue;
      ++buckets;
      const double le = parse_prom_value(s.labels.at("le"));
      EXPECT_GT(le, last_le) << family << ": le not rising";
      EXPECT_GE(s.value, last_count) << family << ": bucket counts fall at le=" << s.labels.at("le");
      last_le = le, last_count = s.value;
    }
    EXPECT_GT(buckets, 1) << family;
    EXPECT_TRUE(std::isinf(last_le)) << family << ": the last bucket is not +Inf";
    EXPECT_EQ(e.value(family + "_count"), last_count) << family;
    EXPECT_TRUE(e.value(family + "_sum").has_value()) << family;
  }
  return e;
}

}  // namespace tpmoe::test
