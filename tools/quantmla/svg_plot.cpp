#include "svg_plot.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <numbers>
#include <numeric>
#include <sstream>
#include <tuple>

namespace quantmla::cli {
namespace {

constexpr double kPanelWidth = 540, kPanelHeight = 420, kMargin = 84, kTop = 50;
// Space above the panels for the plot title.
constexpr double kTitleHeight = 20;
constexpr double kMarkerRadius = 4.5;
constexpr double kIndexFontSize = 11, kLegendFontSize = 11, kLegendRowHeight = 17;
// Advance of one character per px of font size: a little over the average of lower case and
// digits in common sans-serif fonts (DejaVu Sans, Helvetica), so that the legend's columns do not
// run into each other whichever font the viewer picks.
constexpr double kCharWidth = 0.6;
// Bold digits and commas of the index labels, taken at their widest (DejaVu Sans Bold), as label
// boxes must hold their text for the collision test to mean anything.
constexpr double kBoldDigitWidth = 0.7, kBoldCommaWidth = 0.4;
// More ticks than this crowd the tick labels of a 436 px wide axis.
constexpr int kMaxTicks = 7;
// A log axis cannot place values <= 0; they get a band of their own below the lowest decade.
constexpr double kZeroBand = 30, kZeroRowAbove = 12;

std::string escape(const std::string& text) {
  std::string out;
  for (char ch : text) {
    if (ch == '<')
      out += "&lt;";
    else if (ch == '>')
      out += "&gt;";
    else if (ch == '&')
      out += "&amp;";
    else
      out += ch;
  }
  return out;
}

// Fixed-point text; rounding a tiny negative value must not print "-0".
std::string fixed(double value, int decimals) {
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), "%.*f", decimals, value);
  std::string text = buffer;
  if (text.find_first_not_of("-0.") == std::string::npos && text.front() == '-') text.erase(0, 1);
  return text;
}

double text_width(const std::string& text, double font_size) {
  return static_cast<double>(text.size()) * kCharWidth * font_size;
}

// Width of an index label such as "6,8,10".
double index_width(const std::string& text) {
  const auto commas = static_cast<double>(std::count(text.begin(), text.end(), ','));
  const double digits = static_cast<double>(text.size()) - commas;
  return (digits * kBoldDigitWidth + commas * kBoldCommaWidth) * kIndexFontSize;
}

// Axis range padded by 8% so no point sits on the frame.
std::pair<double, double> padded_range(double lo, double hi) {
  if (hi - lo < 1e-12) {
    lo -= 0.5;
    hi += 0.5;
  }
  const double pad = 0.08 * (hi - lo);
  return {lo - pad, hi + pad};
}

// The range of an axis in axis units (log10 of the value on a log axis) and its ticks.
struct Axis {
  double lo = 0, hi = 1;
  std::vector<double> ticks;
  std::vector<std::string> tick_labels;
};

// Ticks at multiples of a 1-2-5 step, labelled with just the decimals that step needs.
Axis linear_axis(double lo, double hi) {
  Axis axis;
  std::tie(axis.lo, axis.hi) = padded_range(lo, hi);
  const auto count = [&](double step) {
    return std::floor(axis.hi / step) - std::ceil(axis.lo / step) + 1;
  };
  double step = 0;
  const double decade = std::pow(10.0, std::floor(std::log10((axis.hi - axis.lo) / kMaxTicks)));
  for (int i = 0; step == 0 || count(step) > kMaxTicks; ++i) {
    constexpr double kMantissas[] = {1, 2, 5};
    step = kMantissas[i % 3] * decade * std::pow(10.0, i / 3);
  }
  const int decimals = std::max(0, static_cast<int>(-std::floor(std::log10(step) + 1e-9)));
  for (double k = std::ceil(axis.lo / step); k * step <= axis.hi; ++k) {
    axis.ticks.push_back(k * step);
    axis.tick_labels.push_back(fixed(k * step, decimals));
  }
  return axis;
}

// Ticks at powers of ten. All labels of one axis share a style: plain decimals (0.001, 100) when
// every tick is short that way, otherwise exponents (1e-06).
Axis log_axis(double lo, double hi) {
  Axis axis;
  std::tie(axis.lo, axis.hi) = padded_range(lo, hi);
  // Fewer than two decades inside would leave the axis unreadable: widen it to whole decades.
  if (std::floor(axis.hi) - std::ceil(axis.lo) < 1) {
    axis.lo = std::floor(axis.lo);
    axis.hi = std::max(std::ceil(axis.hi), axis.lo + 1);
  }
  const int first = static_cast<int>(std::ceil(axis.lo)),
            last = static_cast<int>(std::floor(axis.hi));
  const int stride = (last - first + kMaxTicks) / kMaxTicks;
  std::vector<int> exponents;
  for (int e = first; e <= last; ++e) {
    if (((e % stride) + stride) % stride == 0) exponents.push_back(e);
  }
  const bool plain = exponents.front() >= -4 && exponents.back() <= 5;
  for (int e : exponents) {
    char buffer[32];
    std::snprintf(buffer, sizeof(buffer), "%.0e", std::pow(10.0, e));
    axis.ticks.push_back(e);
    axis.tick_labels.push_back(plain ? fixed(std::pow(10.0, e), std::max(0, -e)) : buffer);
  }
  return axis;
}

struct Box {
  double left, top, right, bottom;
};

bool overlaps(const Box& a, const Box& b) {
  return a.left < b.right && b.left < a.right && a.top < b.bottom && b.top < a.bottom;
}

bool contains(const Box& outer, const Box& inner) {
  return inner.left >= outer.left && inner.right <= outer.right && inner.top >= outer.top &&
         inner.bottom <= outer.bottom;
}

struct Segment {
  double x1, y1, x2, y2;
};

// Whether a line crosses a box, tested at 1 px intervals: exact enough for a few leader lines.
bool crosses(const Segment& line, const Box& box) {
  const int steps = 1 + static_cast<int>(std::hypot(line.x2 - line.x1, line.y2 - line.y1));
  for (int i = 0; i <= steps; ++i) {
    const double t = static_cast<double>(i) / steps;
    const double x = line.x1 + t * (line.x2 - line.x1), y = line.y1 + t * (line.y2 - line.y1);
    if (x > box.left && x < box.right && y > box.top && y < box.bottom) return true;
  }
  return false;
}

// Whether two lines cross. Touching ends count too, as they would read as one bent line; so do
// collinear lines even apart, which only rules out a few more spots.
bool crosses(const Segment& a, const Segment& b) {
  const auto side = [](double ax, double ay, double bx, double by, double px, double py) {
    const double cross = (bx - ax) * (py - ay) - (by - ay) * (px - ax);
    return (cross > 0) - (cross < 0);
  };
  return side(a.x1, a.y1, a.x2, a.y2, b.x1, b.y1) * side(a.x1, a.y1, a.x2, a.y2, b.x2, b.y2) <= 0 &&
         side(b.x1, b.y1, b.x2, b.y2, a.x1, a.y1) * side(b.x1, b.y1, b.x2, b.y2, a.x2, a.y2) <= 0;
}

// One marker, or several touching ones labelled once with all their indices ("3,6,8").
struct Cluster {
  std::vector<int> members;  // positions in the panel's point list
  Box markers{};             // bounding box of the markers
  int first = 0;             // lowest index
  std::string text;
};

// Groups markers whose centres are closer than a marker's diameter: they overlap too much for
// separate labels to say which marker is which.
std::vector<Cluster> clusters_of(const std::vector<double>& xs, const std::vector<double>& ys,
                                 const std::vector<int>& indices) {
  const size_t n = xs.size();
  std::vector<size_t> parent(n);
  std::iota(parent.begin(), parent.end(), size_t{0});
  const auto root = [&](size_t i) {
    while (parent[i] != i) i = parent[i];
    return i;
  };
  for (size_t i = 0; i < n; ++i) {
    for (size_t j = i + 1; j < n; ++j) {
      if (std::hypot(xs[i] - xs[j], ys[i] - ys[j]) < 2 * kMarkerRadius) parent[root(j)] = root(i);
    }
  }
  std::map<size_t, Cluster> by_root;
  for (size_t i = 0; i < n; ++i) by_root[root(i)].members.push_back(static_cast<int>(i));
  std::vector<Cluster> clusters;
  for (auto& [unused, cluster] : by_root) {
    cluster.markers = {1e300, 1e300, -1e300, -1e300};
    std::vector<int> numbers;
    for (int i : cluster.members) {
      cluster.markers.left = std::min(cluster.markers.left, xs[i] - kMarkerRadius);
      cluster.markers.right = std::max(cluster.markers.right, xs[i] + kMarkerRadius);
      cluster.markers.top = std::min(cluster.markers.top, ys[i] - kMarkerRadius);
      cluster.markers.bottom = std::max(cluster.markers.bottom, ys[i] + kMarkerRadius);
      numbers.push_back(indices[i]);
    }
    std::sort(numbers.begin(), numbers.end());
    cluster.first = numbers.front();
    for (int number : numbers) {
      cluster.text += (cluster.text.empty() ? "" : ",") + std::to_string(number);
    }
    clusters.push_back(std::move(cluster));
  }
  std::sort(clusters.begin(), clusters.end(),
            [](const Cluster& a, const Cluster& b) { return a.first < b.first; });
  return clusters;
}

// A placed index label; the leader is drawn only for labels placed away from their markers.
struct Label {
  Box box{};
  bool has_leader = false;
  Segment leader{};
};

struct Layout {
  std::vector<Label> labels;  // one per cluster, in the clusters' order
  double cost = 0;            // lower is better
};

// Costs of a layout besides the length of its leaders: a label that fits nowhere dwarfs
// everything, then each rule relaxed for a label, then each leader at all.
constexpr double kUnplacedCost = 1e9, kRelaxedCost = 1e5, kLeaderCost = 20;

// Places the clusters' labels greedily in `order`: first right next to their markers (right,
// left, above, below, then the corners), then on rings further out with a leader line back to
// the markers. A label stays inside `inner` and overlaps no marker, no label placed before it and
// no leader. Its leader crosses no other marker, label or leader, so that it cannot seem to point
// at another marker; where no spot allows that (a marker enclosed by others), those rules for the
// leader are relaxed one by one. A label that still fits nowhere goes right of its markers.
Layout place_labels(const std::vector<Cluster>& clusters, const std::vector<size_t>& order,
                    const std::vector<Box>& markers, const Box& inner) {
  Layout layout;
  layout.labels.resize(clusters.size());
  std::vector<Box> boxes;
  std::vector<Segment> leaders;
  for (size_t k : order) {
    const Cluster& cluster = clusters[k];
    const double w = index_width(cluster.text) + 4, h = kIndexFontSize + 3;
    const Box& m = cluster.markers;
    const double cx = (m.left + m.right) / 2, cy = (m.top + m.bottom) / 2, gap = 2;
    std::vector<Box> candidates = {
        {m.right + gap, cy - h / 2, m.right + gap + w, cy + h / 2},
        {m.left - gap - w, cy - h / 2, m.left - gap, cy + h / 2},
        {cx - w / 2, m.top - gap - h, cx + w / 2, m.top - gap},
        {cx - w / 2, m.bottom + gap, cx + w / 2, m.bottom + gap + h},
        {m.right, m.top - h, m.right + w, m.top},
        {m.right, m.bottom, m.right + w, m.bottom + h},
        {m.left - w, m.top - h, m.left, m.top},
        {m.left - w, m.bottom, m.left, m.bottom + h},
    };
    const size_t adjacent = candidates.size();
    const double reach = std::max(m.right - m.left, m.bottom - m.top) / 2;
    for (int ring = 1; ring <= 12; ++ring) {
      for (int j = 0; j < 16; ++j) {
        const double angle = 2 * std::numbers::pi * j / 16;
        const double dx = std::cos(angle), dy = -std::sin(angle);
        const double d = reach + 6 + 12 * ring + std::abs(dx) * w / 2 + std::abs(dy) * h / 2;
        const double bx = cx + dx * d, by = cy + dy * d;
        candidates.push_back({bx - w / 2, by - h / 2, bx + w / 2, by + h / 2});
      }
    }
    const auto is_member = [&](size_t i) {
      return std::find(cluster.members.begin(), cluster.members.end(), static_cast<int>(i)) !=
             cluster.members.end();
    };
    // Strictness 3 demands every rule; 2 lets the leader cross other markers, 1 also other
    // leaders, 0 also labels (drawn over it, so it never strikes through their digits).
    const auto fits = [&](size_t c, int strictness, Segment& leader) {
      const Box& box = candidates[c];
      const auto hit = [&](const Box& other) { return overlaps(other, box); };
      if (!contains(inner, box) || std::any_of(markers.begin(), markers.end(), hit) ||
          std::any_of(boxes.begin(), boxes.end(), hit) ||
          std::any_of(leaders.begin(), leaders.end(),
                      [&](const Segment& other) { return crosses(other, box); })) {
        return false;
      }
      if (c < adjacent) return true;
      // From the markers' edge to the label's edge, along the line between their centres.
      const double bx = (box.left + box.right) / 2, by = (box.top + box.bottom) / 2;
      const double dx = bx - cx, dy = by - cy, length = std::hypot(dx, dy);
      const double into_box = std::min(std::abs(dx) > 0 ? w / 2 / std::abs(dx) : 1e300,
                                       std::abs(dy) > 0 ? h / 2 / std::abs(dy) : 1e300);
      const double start = (reach + 1) / length;
      leader = {cx + dx * start, cy + dy * start, bx - dx * into_box, by - dy * into_box};
      if (strictness >= 1 && std::any_of(boxes.begin(), boxes.end(), [&](const Box& other) {
            return crosses(leader, other);
          })) {
        return false;
      }
      if (strictness >= 2 && std::any_of(leaders.begin(), leaders.end(), [&](const Segment& other) {
            return crosses(leader, other);
          })) {
        return false;
      }
      for (size_t i = 0; i < markers.size() && strictness >= 3; ++i) {
        if (!is_member(i) && crosses(leader, markers[i])) return false;
      }
      return true;
    };
    Label& label = layout.labels[k];
    bool found = false;
    for (int strictness = 3; strictness >= 0 && !found; --strictness) {
      for (size_t c = 0; c < candidates.size() && !found; ++c) {
        Segment leader{};
        if (!fits(c, strictness, leader)) continue;
        found = true;
        label = {candidates[c], c >= adjacent, leader};
        layout.cost += (3 - strictness) * kRelaxedCost;
        if (label.has_leader) {
          layout.cost += kLeaderCost + std::hypot(leader.x2 - leader.x1, leader.y2 - leader.y1);
        }
      }
    }
    if (!found) {
      // Overlapping something, but at least inside the frame.
      Box box = candidates[0];
      const double shift_x = std::min(0.0, inner.right - box.right);
      const double shift_y =
          std::max(0.0, inner.top - box.top) + std::min(0.0, inner.bottom - box.bottom);
      label.box = {box.left + shift_x, box.top + shift_y, box.right + shift_x,
                   box.bottom + shift_y};
      layout.cost += kUnplacedCost;
    }
    boxes.push_back(label.box);
    if (label.has_leader) leaders.push_back(label.leader);
  }
  return layout;
}

// Greedy placement depends on the order, so a few fixed orders are tried and the cheapest layout
// drawn: a label placed early can wall in a marker labelled later.
void draw_index_labels(std::ostringstream& svg, const std::vector<Cluster>& clusters,
                       const std::vector<double>& xs, const std::vector<double>& ys,
                       const Box& frame) {
  std::vector<Box> markers;
  for (size_t i = 0; i < xs.size(); ++i) {
    const double r = kMarkerRadius + 1;
    markers.push_back({xs[i] - r, ys[i] - r, xs[i] + r, ys[i] + r});
  }
  const Box inner{frame.left + 2, frame.top + 2, frame.right - 2, frame.bottom - 2};
  // Other markers within 40 px: the crowded clusters have the fewest free spots.
  std::vector<int> crowd(clusters.size(), 0);
  for (size_t k = 0; k < clusters.size(); ++k) {
    const Box& m = clusters[k].markers;
    for (size_t i = 0; i < xs.size(); ++i) {
      const double dx = xs[i] - (m.left + m.right) / 2, dy = ys[i] - (m.top + m.bottom) / 2;
      crowd[k] += std::hypot(dx, dy) < 40 ? 1 : 0;
    }
    crowd[k] -= static_cast<int>(clusters[k].members.size());
  }
  using Before = std::function<bool(size_t, size_t)>;
  const std::vector<Before> orders = {
      // Larger clusters first, as their wider labels are the hardest to fit.
      [&](size_t a, size_t b) { return clusters[a].members.size() > clusters[b].members.size(); },
      [&](size_t a, size_t b) { return crowd[a] > crowd[b]; },
      [&](size_t a, size_t b) { return crowd[a] < crowd[b]; },
      [&](size_t a, size_t b) { return clusters[a].markers.top < clusters[b].markers.top; },
      [&](size_t a, size_t b) { return clusters[a].markers.left < clusters[b].markers.left; },
      [&](size_t a, size_t b) { return clusters[a].first > clusters[b].first; },
  };
  Layout best;
  for (const Before& before : orders) {
    std::vector<size_t> order(clusters.size());
    std::iota(order.begin(), order.end(), size_t{0});
    // Ties keep the order of the lowest index, so the layout depends on the data alone.
    std::stable_sort(order.begin(), order.end(), before);
    Layout layout = place_labels(clusters, order, markers, inner);
    if (best.labels.empty() || layout.cost < best.cost) best = std::move(layout);
  }
  // Leaders first, so that labels drawn over them keep their digits clear.
  for (const Label& label : best.labels) {
    if (!label.has_leader) continue;
    svg << "<line x1='" << label.leader.x1 << "' y1='" << label.leader.y1 << "' x2='"
        << label.leader.x2 << "' y2='" << label.leader.y2
        << "' stroke='#666' stroke-width='0.8'/>\n";
  }
  for (size_t k = 0; k < clusters.size(); ++k) {
    const Box& box = best.labels[k].box;
    const Box& m = clusters[k].markers;
    // The text hugs the side facing its markers; the box's slack for wide fonts goes outwards.
    const char* anchor = "middle";
    double x = (box.left + box.right) / 2;
    if (box.left >= m.right - 0.5) anchor = "start", x = box.left + 2;
    if (box.right <= m.left + 0.5) anchor = "end", x = box.right - 2;
    // A white backing keeps the digits readable over grid lines.
    svg << "<rect x='" << box.left << "' y='" << box.top << "' width='" << box.right - box.left
        << "' height='" << box.bottom - box.top
        << "' fill='white' fill-opacity='0.85' stroke='none'/>\n";
    svg << "<text x='" << x << "' y='" << box.bottom - 3.5 << "' text-anchor='" << anchor
        << "' font-size='" << kIndexFontSize << "' font-weight='bold' fill='#1f4e79'>"
        << clusters[k].text << "</text>\n";
  }
}

bool off_log_scale(const PlotPanel& panel, const PlotPoint& p) { return panel.log_y && p.y <= 0; }

// Draws one panel; `index_of` gives each point's number in the legend.
void draw_panel(std::ostringstream& svg, const PlotPanel& panel, double left,
                const std::map<std::string, int>& index_of) {
  const double width = kPanelWidth - kMargin - 20, height = kPanelHeight - kTop - kMargin;
  bool any_zero = false, any_negative = false;
  double x_lo = 1e300, x_hi = -1e300, y_lo = 1e300, y_hi = -1e300;
  for (const PlotPoint& p : panel.points) {
    x_lo = std::min(x_lo, p.x), x_hi = std::max(x_hi, p.x);
    if (off_log_scale(panel, p)) {
      any_zero = true;
      any_negative = any_negative || p.y < 0;
      continue;
    }
    const double v = panel.log_y ? std::log10(p.y) : p.y;
    y_lo = std::min(y_lo, v), y_hi = std::max(y_hi, v);
  }
  if (x_lo > x_hi) x_lo = x_hi = 0;
  if (y_lo > y_hi) y_lo = y_hi = panel.log_y ? -1 : 0;
  const Axis x_axis = linear_axis(x_lo, x_hi);
  const Axis y_axis = panel.log_y ? log_axis(y_lo, y_hi) : linear_axis(std::min(y_lo, 0.0), y_hi);
  const double x0 = left + kMargin, y0 = kTop + height;
  // The bottom of the scaled part of the y axis; below it, the band for values off the log scale.
  const double scale_bottom = any_zero ? y0 - kZeroBand : y0, zero_row = y0 - kZeroRowAbove;
  const auto sx = [&](double x) { return x0 + (x - x_axis.lo) / (x_axis.hi - x_axis.lo) * width; };
  // Screen position of a value already on the axis scale.
  const auto sy = [&](double v) {
    return scale_bottom - (v - y_axis.lo) / (y_axis.hi - y_axis.lo) * (scale_bottom - kTop);
  };

  svg << "<text x='" << x0 + width / 2 << "' y='" << kTop - 15
      << "' text-anchor='middle' font-size='15' font-weight='bold'>" << escape(panel.title)
      << "</text>\n";
  for (size_t t = 0; t < x_axis.ticks.size(); ++t) {
    const double x = sx(x_axis.ticks[t]);
    svg << "<line x1='" << x << "' y1='" << y0 << "' x2='" << x << "' y2='" << kTop
        << "' stroke='#ddd'/>\n<line x1='" << x << "' y1='" << y0 << "' x2='" << x << "' y2='"
        << y0 + 4 << "' stroke='#444'/>\n<text x='" << x << "' y='" << y0 + 18
        << "' text-anchor='middle' font-size='11'>" << x_axis.tick_labels[t] << "</text>\n";
  }
  for (size_t t = 0; t < y_axis.ticks.size(); ++t) {
    const double y = sy(y_axis.ticks[t]);
    svg << "<line x1='" << x0 << "' y1='" << y << "' x2='" << x0 + width << "' y2='" << y
        << "' stroke='#ddd'/>\n<line x1='" << x0 - 4 << "' y1='" << y << "' x2='" << x0 << "' y2='"
        << y << "' stroke='#444'/>\n<text x='" << x0 - 7 << "' y='" << y + 4
        << "' text-anchor='end' font-size='11'>" << y_axis.tick_labels[t] << "</text>\n";
  }
  if (!panel.log_y && y_axis.lo < 0 && y_axis.hi > 0) {
    svg << "<line x1='" << x0 << "' y1='" << sy(0) << "' x2='" << x0 + width << "' y2='" << sy(0)
        << "' stroke='#888' stroke-dasharray='4 3'/>\n";
  }
  svg << "<rect x='" << x0 << "' y='" << kTop << "' width='" << width << "' height='" << height
      << "' fill='none' stroke='#444'/>\n";
  if (any_zero) {
    // Its own row with a "0" tick, cut off from the scale by a break mark on the axis, so that
    // nobody reads these points as tiny positive values.
    svg << "<line x1='" << x0 << "' y1='" << zero_row << "' x2='" << x0 + width << "' y2='"
        << zero_row << "' stroke='#ccc' stroke-dasharray='2 3'/>\n<line x1='" << x0 - 4 << "' y1='"
        << zero_row << "' x2='" << x0 << "' y2='" << zero_row << "' stroke='#444'/>\n<text x='"
        << x0 - 7 << "' y='" << zero_row + 4 << "' text-anchor='end' font-size='11'>"
        << (any_negative ? "&lt;= 0" : "0") << "</text>\n";
    const double cut = (scale_bottom + zero_row) / 2;
    svg << "<rect x='" << x0 - 6 << "' y='" << cut - 3
        << "' width='12' height='6' fill='white' stroke='none'/>\n";
    for (double offset : {-3.0, 3.0}) {
      svg << "<line x1='" << x0 - 6 << "' y1='" << cut + offset + 2 << "' x2='" << x0 + 6
          << "' y2='" << cut + offset - 2 << "' stroke='#444'/>\n";
    }
  }
  svg << "<text x='" << x0 + width / 2 << "' y='" << y0 + 42
      << "' text-anchor='middle' font-size='13'>" << escape(panel.x_label) << "</text>\n";
  svg << "<text transform='translate(" << left + 16 << "," << kTop + height / 2
      << ") rotate(-90)' text-anchor='middle' font-size='13'>" << escape(panel.y_label)
      << "</text>\n";

  std::vector<double> xs, ys;
  std::vector<int> indices;
  for (const PlotPoint& p : panel.points) {
    const bool zero = off_log_scale(panel, p);
    xs.push_back(sx(p.x));
    ys.push_back(zero ? zero_row : sy(panel.log_y ? std::log10(p.y) : p.y));
    indices.push_back(index_of.at(p.label));
    // White rims keep overlapping markers apart; values off the log scale are hollow.
    svg << "<circle cx='" << xs.back() << "' cy='" << ys.back() << "' r='" << kMarkerRadius
        << (zero ? "' fill='white' stroke='#1f77b4' stroke-width='1.8'/>\n"
                 : "' fill='#1f77b4' stroke='white' stroke-width='0.8'/>\n");
  }
  draw_index_labels(svg, clusters_of(xs, ys, indices), xs, ys, {x0, kTop, x0 + width, y0});
}

}  // namespace

std::string render_svg(const std::string& title, const std::vector<PlotPanel>& panels) {
  // One number per distinct label, in order of first appearance, shared by all panels.
  std::map<std::string, int> index_of;
  std::vector<std::string> labels;
  bool any_zero = false, any_negative = false;
  for (const PlotPanel& panel : panels) {
    for (const PlotPoint& p : panel.points) {
      if (index_of.try_emplace(p.label, static_cast<int>(labels.size()) + 1).second) {
        labels.push_back(p.label);
      }
      any_zero = any_zero || off_log_scale(panel, p);
      any_negative = any_negative || (off_log_scale(panel, p) && p.y < 0);
    }
  }

  // The legend: columns of "index  label" under the panels, filled top to bottom.
  const double total_width = kPanelWidth * static_cast<double>(std::max<size_t>(panels.size(), 1));
  const double number_width = 24, column_gap = 28;
  double column_width = 0;
  for (const std::string& label : labels) {
    column_width = std::max(column_width, number_width + 6 + text_width(label, kLegendFontSize));
  }
  column_width += column_gap;
  const size_t columns = std::clamp<size_t>(static_cast<size_t>((total_width - 40) / column_width),
                                            1, std::max<size_t>(labels.size(), 1));
  const size_t rows = (labels.size() + columns - 1) / columns;
  const double legend_left =
      (total_width - static_cast<double>(columns) * column_width + column_gap) / 2;
  // Starts just under the x axis titles (at kTop + plot height + 42).
  const double legend_top = kTitleHeight + kPanelHeight - kMargin + 55;
  const double height =
      legend_top + static_cast<double>(rows + (any_zero ? 1 : 0)) * kLegendRowHeight + 10;

  std::ostringstream svg;
  // stroke='none' is SVG's default, but ImageMagick's renderer outlines text and rectangles in
  // black without it.
  svg << "<svg xmlns='http://www.w3.org/2000/svg' width='" << total_width << "' height='" << height
      << "' font-family='sans-serif' stroke='none'>\n";
  svg << "<rect x='0' y='0' width='" << total_width << "' height='" << height
      << "' fill='white' stroke='none'/>\n";
  svg << "<text x='" << total_width / 2 << "' y='20' text-anchor='middle' font-size='16'>"
      << escape(title) << "</text>\n";
  for (size_t i = 0; i < panels.size(); ++i) {
    svg << "<g transform='translate(0," << kTitleHeight << ")'>\n";
    draw_panel(svg, panels[i], kPanelWidth * static_cast<double>(i), index_of);
    svg << "</g>\n";
  }
  for (size_t i = 0; i < labels.size(); ++i) {
    const double x = legend_left + static_cast<double>(i / rows) * column_width;
    const double y = legend_top + static_cast<double>(i % rows + 1) * kLegendRowHeight;
    svg << "<text x='" << x + number_width << "' y='" << y << "' text-anchor='end' font-size='"
        << kLegendFontSize << "' font-weight='bold' fill='#1f4e79'>" << i + 1 << "</text>\n";
    svg << "<text x='" << x + number_width + 6 << "' y='" << y << "' font-size='" << kLegendFontSize
        << "'>" << escape(labels[i]) << "</text>\n";
  }
  if (any_zero) {
    const double y = legend_top + static_cast<double>(rows + 1) * kLegendRowHeight;
    svg << "<circle cx='" << legend_left + number_width - 4 << "' cy='" << y - 4 << "' r='"
        << kMarkerRadius << "' fill='white' stroke='#1f77b4' stroke-width='1.8'/>\n";
    svg << "<text x='" << legend_left + number_width + 6 << "' y='" << y << "' font-size='"
        << kLegendFontSize << "' fill='#444'>hollow marker on the row marked "
        << (any_negative ? "&lt;= 0 of a log axis: the value is 0 or below"
                         : "0 of a log axis: the value is exactly 0")
        << ", which a log scale cannot show</text>\n";
  }
  svg << "</svg>\n";
  return svg.str();
}

}  // namespace quantmla::cli
