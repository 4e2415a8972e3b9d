// A small SVG scatter plot writer for the comparison tables (no plotting dependency needed).
#pragma once

#include <string>
#include <vector>

namespace quantmla::cli {

struct PlotPoint {
  double x = 0.0;
  double y = 0.0;
  // Shown in the legend under the panels; the marker carries the label's number. Points of the
  // same label in several panels share one number.
  std::string label;
};

struct PlotPanel {
  std::string title;
  std::string x_label;
  std::string y_label;
  std::vector<PlotPoint> points;
  // Logarithmic y axis; values <= 0 get hollow markers on a row marked 0 below the scale.
  bool log_y = false;
};

// Panels side by side, each with axes, ticks and numbered points, over a legend of the numbers.
std::string render_svg(const std::string& title, const std::vector<PlotPanel>& panels);

}  // namespace quantmla::cli
