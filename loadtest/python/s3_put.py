#!/usr/bin/env python3
"""Upload a folder to an S3-compatible store (tests: a local moto server).

    python s3_put.py --endpoint http://127.0.0.1:PORT --bucket B --prefix P DIR

Creates the bucket if it is missing, then puts every file under DIR as
P/<path relative to DIR>. Credentials come from the environment (AWS_*),
defaulting to moto's dummy ones.
"""
import argparse
import os

import boto3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--bucket", required=True)
    ap.add_argument("--prefix", required=True)
    ap.add_argument("dir")
    args = ap.parse_args()
    s3 = boto3.client(
        "s3",
        endpoint_url=args.endpoint,
        region_name=os.environ.get("AWS_REGION", "us-east-1"),
        aws_access_key_id=os.environ.get("AWS_ACCESS_KEY_ID", "testing"),
        aws_secret_access_key=os.environ.get("AWS_SECRET_ACCESS_KEY", "testing"),
    )
    existing = {b["Name"] for b in s3.list_buckets().get("Buckets", [])}
    if args.bucket not in existing:
        s3.create_bucket(Bucket=args.bucket)
    n = 0
    for folder, _, names in os.walk(args.dir):
        for name in names:
            path = os.path.join(folder, name)
            key = f"{args.prefix.rstrip('/')}/{os.path.relpath(path, args.dir)}"
            s3.upload_file(path, args.bucket, key)
            n += 1
    print(f"put {n} objects under s3://{args.bucket}/{args.prefix}")


if __name__ == "__main__":
    main()
