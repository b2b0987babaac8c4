#include "tune/plot.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <fstream>
#include <limits>

namespace expertd::tune {

namespace {

// Distinguishable on white and for the common colour-vision deficiencies (Tableau 10).
constexpr const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
                                   "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"};
constexpr size_t kColorCount = sizeof(kColors) / sizeof(kColors[0]);

constexpr double kWidth = 1040;
constexpr double kMargin = 20;
constexpr double kHeaderHeight = 64;  // title and subtitle
constexpr double kPanelTop = 30;      // the panel's title above its plot area
constexpr double kPlotHeight = 300;
constexpr double kPanelBottom = 52;  // x tick labels and the x axis title
constexpr double kPlotLeft = 72;     // y tick labels and the y axis title
constexpr double kPlotRight = 16;
constexpr double kLegendRow = 22;
constexpr double kCharWidth = 0.6 * 12;  // average advance of 12 px sans-serif, for layout

std::string escape(const std::string& s) {
  std::string out;
  for (const char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string tick_label(double v, double step) {
  if (step >= 1 || v == 0) return fmt::format("{:.0f}", v);
  const int decimals = std::clamp(static_cast<int>(std::ceil(-std::log10(step))), 1, 6);
  return fmt::format("{:.{}f}", v, decimals);
}

bool finite_all(const std::vector<double>& v) {
  return std::all_of(v.begin(), v.end(), [](double x) { return std::isfinite(x); });
}

struct Frame {  // one panel's plot area in SVG coordinates and its data ranges
  double left, top, width, height;
  double x0, x1, y0, y1;
  double sx(double x) const { return left + (x - x0) / (x1 - x0) * width; }
  double sy(double y) const { return top + height - (y - y0) / (y1 - y0) * height; }
};

void render_panel(std::string& out, const PlotPanel& p, double left, double width) {
  double xmin = std::numeric_limits<double>::infinity();
  double xmax = -xmin;
  double ymax = 0;
  for (const auto& s : p.series) {
    for (const double x : s.x) {
      xmin = std::min(xmin, x);
      xmax = std::max(xmax, x);
    }
    for (const double y : s.y) ymax = std::max(ymax, std::isfinite(y) ? y : 0.0);
    for (const double y : s.bound) ymax = std::max(ymax, std::isfinite(y) ? y : 0.0);
  }
  if (!std::isfinite(xmin)) xmin = xmax = 0;
  if (ymax <= 0) ymax = 1;
  const std::vector<double> yticks = nice_ticks(0, ymax, 5);
  std::vector<double> xticks;
  if (p.integer_x && xmax - xmin <= 16) {
    for (double x = std::floor(xmin); x <= xmax + 1e-9; x += 1) xticks.push_back(x);
  } else {
    xticks = nice_ticks(xmin, xmax, 6);
  }
  const double pad = std::max((xmax - xmin) * 0.06, 0.25);
  Frame f{left + kPlotLeft,
          kHeaderHeight + kPanelTop,
          width - kPlotLeft - kPlotRight,
          kPlotHeight,
          xmin - pad,
          xmax + pad,
          0,
          std::max(yticks.back(), ymax)};

  out += fmt::format("<g class=\"panel\" data-title=\"{}\">\n", escape(p.title));
  out += fmt::format(
      "<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"14\" font-weight=\"bold\" "
      "text-anchor=\"middle\">{}</text>\n",
      f.left + f.width / 2, f.top - 12, escape(p.title));
  // Grid and y ticks.
  const double ystep = yticks.size() > 1 ? yticks[1] - yticks[0] : 1;
  for (const double y : yticks) {
    const double py = f.sy(y);
    out += fmt::format(
        "<line x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"#e5e5e5\"/>\n",
        f.left, py, f.left + f.width, py);
    out += fmt::format(
        "<line x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"#333\"/>\n",
        f.left - 5, py, f.left, py);
    out += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"end\">{}</text>\n",
                       f.left - 8, py + 4, tick_label(y, ystep));
  }
  const double xstep = xticks.size() > 1 ? xticks[1] - xticks[0] : 1;
  for (const double x : xticks) {
    const double px = f.sx(x);
    out += fmt::format(
        "<line x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"#333\"/>\n", px,
        f.top + f.height, px, f.top + f.height + 5);
    out += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">{}</text>\n", px,
                       f.top + f.height + 19, tick_label(x, xstep));
  }
  // Axes and their titles.
  out += fmt::format("<path d=\"M{:.1f},{:.1f} V{:.1f} H{:.1f}\" fill=\"none\" stroke=\"#333\"/>\n",
                     f.left, f.top, f.top + f.height, f.left + f.width);
  out += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">{}</text>\n",
                     f.left + f.width / 2, f.top + f.height + 40, escape(p.x_label));
  const double ty = f.top + f.height / 2;
  const double tx = left + 16;
  out += fmt::format(
      "<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\" "
      "transform=\"rotate(-90 {:.1f} {:.1f})\">{}</text>\n",
      tx, ty, tx, ty, escape(p.y_label));
  // Series: the bound (dashed) under the measured line.
  for (size_t i = 0; i < p.series.size(); ++i) {
    const PlotSeries& s = p.series[i];
    const char* color = kColors[i % kColorCount];
    out += fmt::format("<g class=\"series\" data-label=\"{}\">\n<title>{}</title>\n",
                       escape(s.label), escape(s.label));
    auto points = [&](const std::vector<double>& ys) {
      std::string pts;
      for (size_t k = 0; k < s.x.size() && k < ys.size(); ++k) {
        if (!std::isfinite(ys[k])) continue;
        pts += fmt::format("{}{:.1f},{:.1f}", pts.empty() ? "" : " ", f.sx(s.x[k]), f.sy(ys[k]));
      }
      return pts;
    };
    if (!s.bound.empty() && finite_all(s.x)) {
      out += fmt::format(
          "<polyline class=\"bound\" points=\"{}\" fill=\"none\" stroke=\"{}\" "
          "stroke-width=\"1.5\" stroke-dasharray=\"6 4\" opacity=\"0.8\"/>\n",
          points(s.bound), color);
    }
    out += fmt::format(
        "<polyline class=\"measured\" points=\"{}\" fill=\"none\" stroke=\"{}\" "
        "stroke-width=\"2.2\"/>\n",
        points(s.y), color);
    for (size_t k = 0; k < s.x.size() && k < s.y.size(); ++k) {
      if (!std::isfinite(s.y[k])) continue;
      out += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"3.5\" fill=\"{}\"/>\n",
                         f.sx(s.x[k]), f.sy(s.y[k]), color);
    }
    out += "</g>\n";
  }
  out += "</g>\n";
}

}  // namespace

std::vector<double> nice_ticks(double lo, double hi, int target) {
  if (!(hi > lo)) hi = lo + 1;
  const double raw = (hi - lo) / std::max(target, 1);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag;
  for (const double m : {1.0, 2.0, 5.0, 10.0}) {
    step = m * mag;
    if (step >= raw) break;
  }
  std::vector<double> ticks;
  const double first = std::floor(lo / step + 1e-9);
  // Multiples of the step, each computed afresh (no accumulated rounding); at most 64 of them
  // whatever range a caller passes.
  for (int i = 0; i < 64 && (ticks.empty() || ticks.back() < hi - 1e-9 * step); ++i) {
    ticks.push_back((first + i) * step);
  }
  return ticks;
}

std::string render_svg(const PlotSpec& spec) {
  // The legend: every label of the first panel (the panels share their series), then the bound.
  std::vector<std::string> labels;
  if (!spec.panels.empty()) {
    for (const auto& s : spec.panels.front().series) labels.push_back(s.label);
  }
  const double legend_top = kHeaderHeight + kPanelTop + kPlotHeight + kPanelBottom + 12;
  struct Entry {
    double x, y;
    std::string label;
    int color;  // -1: the dashed bound sample
  };
  std::vector<Entry> entries;
  double x = kMargin;
  double y = legend_top;
  auto place = [&](const std::string& label, int color) {
    const double w = 36 + kCharWidth * static_cast<double>(label.size()) + 24;
    if (x + w > kWidth - kMargin && x > kMargin) {
      x = kMargin;
      y += kLegendRow;
    }
    entries.push_back({x, y, label, color});
    x += w;
  };
  for (size_t i = 0; i < labels.size(); ++i) place(labels[i], static_cast<int>(i % kColorCount));
  if (!spec.bound_label.empty()) place(spec.bound_label, -1);
  const double height = y + kLegendRow + kMargin;

  std::string out;
  out += fmt::format(
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0:.0f}\" height=\"{1:.0f}\" "
      "viewBox=\"0 0 {0:.0f} {1:.0f}\" font-family=\"sans-serif\" font-size=\"12\" "
      "fill=\"#222\">\n",
      kWidth, height);
  out += "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  out += fmt::format(
      "<text x=\"{:.1f}\" y=\"26\" font-size=\"17\" font-weight=\"bold\" "
      "text-anchor=\"middle\">{}</text>\n",
      kWidth / 2, escape(spec.title));
  out += fmt::format(
      "<text x=\"{:.1f}\" y=\"46\" font-size=\"12\" fill=\"#555\" "
      "text-anchor=\"middle\">{}</text>\n",
      kWidth / 2, escape(spec.subtitle));
  const size_t n = std::max<size_t>(spec.panels.size(), 1);
  const double panel_width = (kWidth - 2 * kMargin) / static_cast<double>(n);
  for (size_t i = 0; i < spec.panels.size(); ++i) {
    render_panel(out, spec.panels[i], kMargin + panel_width * static_cast<double>(i), panel_width);
  }
  out += "<g class=\"legend\">\n";
  for (const Entry& e : entries) {
    const double ly = e.y + 4;
    if (e.color < 0) {
      out += fmt::format(
          "<line x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"#555\" "
          "stroke-width=\"1.5\" stroke-dasharray=\"6 4\"/>\n",
          e.x, ly, e.x + 28, ly);
    } else {
      const char* color = kColors[e.color];
      out += fmt::format(
          "<line x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"{}\" "
          "stroke-width=\"2.2\"/>\n<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"3.5\" fill=\"{}\"/>\n",
          e.x, ly, e.x + 28, ly, color, e.x + 14, ly, color);
    }
    out += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\">{}</text>\n", e.x + 36, ly + 4,
                       escape(e.label));
  }
  out += "</g>\n</svg>\n";
  return out;
}

Status write_svg(const std::string& path, const PlotSpec& spec) {
  const std::string svg = render_svg(spec);
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) {
    const int e = errno;  // before the format below
    return make_error(e ? e : EIO, fmt::format("{}: cannot create the plot", path));
  }
  f.write(svg.data(), static_cast<std::streamsize>(svg.size()));
  f.close();
  if (!f) return make_error(EIO, fmt::format("{}: writing the plot failed", path));
  return Ok{};
}

}  // namespace expertd::tune
