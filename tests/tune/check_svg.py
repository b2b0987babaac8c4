#!/usr/bin/env python3
"""Checks a plot written by `expert-tune sweep --plot`: a well-formed, self-contained SVG document
(no scripts, no external references) whose every panel holds the expected series, each with one
marker per point, a measured line and a dashed bound line.

usage: check_svg.py PLOT.svg --panels 2 --series N --points M
Prints "ok: ..." and exits 0, or prints what is wrong and exits 1.
"""
import argparse
import sys
import xml.etree.ElementTree as ET

SVG = "{http://www.w3.org/2000/svg}"


def fail(msg):
    print(f"check_svg: {msg}")
    sys.exit(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("svg")
    ap.add_argument("--panels", type=int, required=True)
    ap.add_argument("--series", type=int, required=True)
    ap.add_argument("--points", type=int, required=True)
    a = ap.parse_args()
    try:
        root = ET.parse(a.svg).getroot()
    except ET.ParseError as e:
        fail(f"{a.svg}: not well-formed XML: {e}")
    if root.tag != SVG + "svg":
        fail(f"root element is {root.tag}, not svg")
    for el in root.iter():
        if el.tag in (SVG + "script", SVG + "image", SVG + "foreignObject", SVG + "use"):
            fail(f"{el.tag} element: the plot must be self-contained")
        for k, v in el.attrib.items():
            if k.endswith("href") or "url(" in v or "@import" in v:
                fail(f"external reference {k}={v!r}")
        if el.tag == SVG + "style":
            fail("a style element: the plot styles its elements directly")
    panels = [g for g in root.iter(SVG + "g") if g.get("class") == "panel"]
    if len(panels) != a.panels:
        fail(f"{len(panels)} panels, expected {a.panels}")
    for p in panels:
        title = p.get("data-title")
        series = [g for g in p.iter(SVG + "g") if g.get("class") == "series"]
        labels = [g.get("data-label") for g in series]
        if len(series) != a.series or len(set(labels)) != a.series:
            fail(f"panel {title!r}: series {labels}, expected {a.series} distinct ones")
        for g in series:
            markers = list(g.iter(SVG + "circle"))
            lines = {pl.get("class"): pl for pl in g.iter(SVG + "polyline")}
            if len(markers) != a.points:
                fail(f"panel {title!r}, series {g.get('data-label')!r}: {len(markers)} markers, "
                     f"expected {a.points}")
            if "measured" not in lines or len(lines["measured"].get("points").split()) != a.points:
                fail(f"panel {title!r}, series {g.get('data-label')!r}: no measured line of "
                     f"{a.points} points")
            bound = lines.get("bound")
            if bound is None or not bound.get("stroke-dasharray"):
                fail(f"panel {title!r}, series {g.get('data-label')!r}: no dashed bound line")
        texts = "".join(t.text or "" for t in p.iter(SVG + "text"))
        if not texts:
            fail(f"panel {title!r}: no axis labels")
    legend = [g for g in root.iter(SVG + "g") if g.get("class") == "legend"]
    if len(legend) != 1 or len(list(legend[0].iter(SVG + "text"))) != a.series + 1:
        fail("the legend must name every series and the bound")
    print(f"ok: {a.svg}: {a.panels} panels x {a.series} series x {a.points} points")


if __name__ == "__main__":
    main()
