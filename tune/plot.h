// A small, self-contained SVG line chart for `expert-tune sweep --plot`: panels side by side, each
// with axes, ticks, tick labels and axis titles, one polyline (with markers) per series plus an
// optional dashed bound line in the series' colour, and one legend under the panels. No scripts,
// no external fonts or images: text uses the generic sans-serif family. Every series is a
// <g class="series" data-label="..."> element, so tests (and people) can find it.
// docs/TUNING.md says why this is our own code rather than a plotting library.
#pragma once

#include <string>
#include <vector>

#include "expertd/result.h"

namespace expertd::tune {

struct PlotSeries {
  std::string label;
  std::vector<double> x;
  std::vector<double> y;
  std::vector<double> bound;  // empty, or one per x: drawn dashed
};

struct PlotPanel {
  std::string title;
  std::string x_label;
  std::string y_label;
  std::vector<PlotSeries> series;
  bool integer_x = true;  // x ticks on whole numbers (depths)
};

struct PlotSpec {
  std::string title;
  std::string subtitle;
  std::vector<PlotPanel> panels;
  std::string bound_label;  // the legend's entry for dashed lines ("" when no series has bounds)
};

// The SVG document.
std::string render_svg(const PlotSpec& spec);
// Writes it to `path`; an error names the file.
Status write_svg(const std::string& path, const PlotSpec& spec);

// "Nice" axis ticks covering [lo, hi]: 1, 2 or 5 times a power of ten apart, about `target` many.
std::vector<double> nice_ticks(double lo, double hi, int target);

}  // namespace expertd::tune
