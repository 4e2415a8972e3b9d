#include "svg_plot.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>
#include <tuple>

namespace quantmla::cli {
namespace {

constexpr double kPanelWidth = 540, kPanelHeight = 420, kMargin = 84, kTop = 50;

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

std::string number(double value) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%.3g", value);
  return buffer;
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

void draw_panel(std::ostringstream& svg, const PlotPanel& panel, double left) {
  const double width = kPanelWidth - kMargin - 20, height = kPanelHeight - kTop - kMargin;
  // On a log axis the smallest positive value, a decade down, stands in for zero and below.
  double smallest_positive = 1e300;
  for (const PlotPoint& p : panel.points) {
    if (p.y > 0) smallest_positive = std::min(smallest_positive, p.y);
  }
  const double floor = smallest_positive < 1e300 ? smallest_positive / 10 : 1e-6;
  const auto axis_y = [&](double y) { return panel.log_y ? std::log10(std::max(y, floor)) : y; };
  double x_lo = 1e300, x_hi = -1e300, y_lo = 1e300, y_hi = -1e300;
  for (const PlotPoint& p : panel.points) {
    x_lo = std::min(x_lo, p.x), x_hi = std::max(x_hi, p.x);
    y_lo = std::min(y_lo, axis_y(p.y)), y_hi = std::max(y_hi, axis_y(p.y));
  }
  std::tie(x_lo, x_hi) = padded_range(x_lo, x_hi);
  std::tie(y_lo, y_hi) = padded_range(panel.log_y ? y_lo : std::min(y_lo, 0.0), y_hi);
  const double x0 = left + kMargin, y0 = kTop + height;
  const auto sx = [&](double x) { return x0 + (x - x_lo) / (x_hi - x_lo) * width; };
  // Screen position of a value already on the axis scale.
  const auto sy = [&](double v) { return y0 - (v - y_lo) / (y_hi - y_lo) * height; };

  svg << "<text x='" << x0 + width / 2 << "' y='" << kTop - 15
      << "' text-anchor='middle' font-size='15' font-weight='bold'>" << escape(panel.title)
      << "</text>\n";
  svg << "<rect x='" << x0 << "' y='" << kTop << "' width='" << width << "' height='" << height
      << "' fill='none' stroke='#444'/>\n";
  for (int t = 0; t <= 5; ++t) {
    const double xv = x_lo + (x_hi - x_lo) * t / 5, yv = y_lo + (y_hi - y_lo) * t / 5;
    svg << "<line x1='" << sx(xv) << "' y1='" << y0 << "' x2='" << sx(xv) << "' y2='" << kTop
        << "' stroke='#ddd'/>\n<text x='" << sx(xv) << "' y='" << y0 + 18
        << "' text-anchor='middle' font-size='11'>" << number(xv) << "</text>\n";
    svg << "<line x1='" << x0 << "' y1='" << sy(yv) << "' x2='" << x0 + width << "' y2='" << sy(yv)
        << "' stroke='#ddd'/>\n<text x='" << x0 - 6 << "' y='" << sy(yv) + 4
        << "' text-anchor='end' font-size='11'>" << number(panel.log_y ? std::pow(10.0, yv) : yv)
        << "</text>\n";
  }
  if (!panel.log_y && y_lo < 0 && y_hi > 0) {
    svg << "<line x1='" << x0 << "' y1='" << sy(0) << "' x2='" << x0 + width << "' y2='" << sy(0)
        << "' stroke='#888' stroke-dasharray='4 3'/>\n";
  }
  svg << "<text x='" << x0 + width / 2 << "' y='" << y0 + 42
      << "' text-anchor='middle' font-size='13'>" << escape(panel.x_label) << "</text>\n";
  svg << "<text transform='translate(" << left + 16 << "," << kTop + height / 2
      << ") rotate(-90)' text-anchor='middle' font-size='13'>" << escape(panel.y_label)
      << "</text>\n";
  for (const PlotPoint& p : panel.points) {
    const double py = sy(axis_y(p.y));
    svg << "<circle cx='" << sx(p.x) << "' cy='" << py << "' r='4.5' fill='#1f77b4'/>\n";
    // Labels of points in the right half go to their left, so they stay inside the panel.
    const bool right_half = sx(p.x) > x0 + width / 2;
    svg << "<text x='" << sx(p.x) + (right_half ? -7 : 7) << "' y='" << py - 6
        << "' font-size='10' text-anchor='" << (right_half ? "end" : "start") << "'>"
        << escape(p.label) << "</text>\n";
  }
}

}  // namespace

std::string render_svg(const std::string& title, const std::vector<PlotPanel>& panels) {
  std::ostringstream svg;
  const double total_width = kPanelWidth * static_cast<double>(panels.size());
  svg << "<svg xmlns='http://www.w3.org/2000/svg' width='" << total_width << "' height='"
      << kPanelHeight + 30 << "' font-family='sans-serif'>\n";
  svg << "<rect width='100%' height='100%' fill='white'/>\n";
  svg << "<text x='" << total_width / 2 << "' y='20' text-anchor='middle' font-size='16'>"
      << escape(title) << "</text>\n";
  for (size_t i = 0; i < panels.size(); ++i) {
    svg << "<g transform='translate(0,20)'>\n";
    draw_panel(svg, panels[i], kPanelWidth * static_cast<double>(i));
    svg << "</g>\n";
  }
  svg << "</svg>\n";
  return svg.str();
}

}  // namespace quantmla::cli
