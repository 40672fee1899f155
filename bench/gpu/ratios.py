#!/usr/bin/env python3
"""The table of rounds and ratios that bench/gpu/h200.sh prints for its bench and cpu stages:
ember's and llama.cpp's JSON results (`ember bench -o json`, `llama-bench -o json`) in FOLDER,
whose file names match PATTERN (a regex with a group `eng`, ember or llama, and optionally `t`,
the threads; with `t` the table has a threads column), grouped by test.

    ratios.py FOLDER PATTERN
"""
import glob
import json
import os
import re
import sys

folder, pattern = sys.argv[1], re.compile(sys.argv[2])
rows = {}
threaded = 't' in pattern.groupindex
for f in sorted(glob.glob(os.path.join(folder, '*.json'))):
    m = pattern.fullmatch(os.path.basename(f))
    if not m:
        continue
    key_t = (int(m.group('t')),) if threaded else ()
    try:
        for x in json.load(open(f)):
            name = ('pp%d' % x['n_prompt'] if x['n_prompt'] else 'tg%d' % x['n_gen']) + ('@d%d' % x['n_depth'] if x.get('n_depth') else '')
            rows.setdefault(key_t + (name,), {}).setdefault(m.group('eng'), []).append(x['avg_ts'])
    except Exception as e:
        print(f, 'unreadable:', e)
print(('| threads ' if threaded else '') + '| test | ember t/s (rounds) | llama.cpp t/s (rounds) | ratio of means |')
print(('| ---: ' if threaded else '') + '| --- | --- | --- | ---: |')
keys = sorted(rows, key=lambda k: (-k[0], k[1])) if threaded else list(rows)
for k in keys:
    e, l = rows[k].get('ember', []), rows[k].get('llama', [])
    ratio = (sum(e) / len(e)) / (sum(l) / len(l)) if e and l else float('nan')
    lead = f'| {k[0]} ' if threaded else ''
    print(f"{lead}| {k[-1]} | {' '.join('%.1f' % v for v in e)} | {' '.join('%.1f' % v for v in l)} | {ratio:.2f} |")
