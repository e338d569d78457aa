"""The neural scorer's command-line options, shared by ``lm-rescore`` and ``lm-serve``: ``--device`` and
``--precision``, checked as they are parsed so that a device or precision this onnxruntime cannot give fails before
any list is read or model loaded."""

from __future__ import annotations

import argparse

from lmserve.rescoring.precision import PRECISIONS, PrecisionError, check_precision
from lmserve.rescoring.scorer import DEVICES, DeviceError, check_device


def add_device_argument(parser: argparse.ArgumentParser, default: str | None = "cpu", where: str = "") -> None:
    """``--device cpu|cuda``, where a command's neural scorer runs (``rescoring.scorer``): checked as it is parsed,
    so that a CUDA device this onnxruntime cannot give fails before any list is read or model loaded."""

    def device(text: str) -> str:
        try:
            return check_device(text)
        except DeviceError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parser.add_argument(
        "--device",
        type=device,
        default=default,
        metavar="{" + ",".join(DEVICES) + "}",
        help=f"where the neural LM runs (default: {where or default}); cuda needs onnxruntime-gpu: lmserve[gpu]",
    )


def add_precision_argument(parser: argparse.ArgumentParser) -> None:
    """``--precision fp32|fp16``, the arithmetic of a command's neural scorer (``rescoring.precision``); a command
    refuses fp16 off ``--device cuda`` among its conflicts (:func:`precision_conflict`)."""
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fp32",
        help="the neural LM's arithmetic (default: %(default)s); fp16 on --device cuda only, its scores within a "
        "stated bound of fp32's",
    )


def precision_conflict(args: argparse.Namespace) -> str | None:
    """Why ``--precision`` cannot run on ``--device``, or None."""
    try:
        check_precision(args.precision, args.device)
    except PrecisionError as e:
        return f"--precision {args.precision} with --device {args.device}: {e}"
    return None
