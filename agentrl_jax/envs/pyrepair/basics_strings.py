"""Basic problems on strings: characters, words, slicing, building strings (see ``basics``)."""

from agentrl_jax.envs.pyrepair.basics_entry import Basic, inputs


@inputs("hello", "", "AEIOU", "xyz", "Programming", "a", "b", "bcd E")
def count_vowels(s):
    """Return the number of vowels (a, e, i, o, u, lower or upper case) in s."""
    count = 0
    for c in s:
        if c.lower() in "aeiou":
            count += 1
    return count


@inputs("ab", "", "a", "hello", "racecar", "abc de")
def reverse_string(s):
    """Return s with its characters in reverse order."""
    result = ""
    for c in s:
        result = c + result
    return result


@inputs("Aba", "", "a", "abc", "Racecar", "ab", "abba", "abca")
def is_palindrome(s):
    """Return True if s reads the same forwards and backwards, ignoring upper/lower case."""
    s = s.lower()
    return s == s[::-1]


@inputs("hello world", "", "a b c", "already Upper", "x", "two  spaces", "mIxed cAse")
def capitalize_words(s):
    """Return s with the first character of each space-separated word upper-cased, the rest kept."""
    words = s.split(" ")
    return " ".join(w[:1].upper() + w[1:] for w in words)


@inputs(("banana", "n"), ("banana", "a"), ("", "a"), ("aaa", "a"), ("abc", "z"), ("Aa", "a"))
def count_char(s, ch):
    """Return how many times the character ch occurs in s."""
    count = 0
    for c in s:
        if c == ch:
            count += 1
    return count


@inputs("ab cd", "", "a bb ccc", "ccc bb a", "tie tie2 abc xyz", "one", "x yy zz")
def longest_word(s):
    """Return the longest whitespace-separated word of s, the first one on ties ('' if none)."""
    best = ""
    for word in s.split():
        if len(word) > len(best):
            best = word
    return best


@inputs("ada lovelace", "", "Grace Brewster Hopper", "x", "a b", "  two   spaces ")
def initials(name):
    """Return the upper-case first letters of the words of name, joined ('ada lovelace' -> 'AL')."""
    return "".join(w[0].upper() for w in name.split())


@inputs(("ab", "abc"), ("listen", "silent"), ("a", "a"), ("Dog", "god"), ("", ""), ("aab", "abb"))
def is_anagram(a, b):
    """Return True if a and b hold the same characters equally often, ignoring upper/lower case."""
    return sorted(a.lower()) == sorted(b.lower())


@inputs(("xyz", 3), ("abc", 1), ("hello, world", 13), ("", 5), ("ABC", 2), ("abc", 26), ("zoo", -1))
def caesar_shift(s, k):
    """Return s with each lower-case letter shifted k places along the alphabet, z wrapping to a."""
    result = ""
    for c in s:
        if "a" <= c <= "z":
            c = chr((ord(c) - ord("a") + k) % 26 + ord("a"))
        result += c
    return result


@inputs("Hello World", "", "ABC", "abc", "AbC", "a1B2", "X")
def count_upper(s):
    """Return the number of upper-case letters in s."""
    return sum(1 for c in s if c.isupper())


@inputs("Hello", "", "ABC", "abc", "a1B2", "MiXeD CaSe")
def swap_case(s):
    """Return s with upper-case letters made lower case and lower-case letters upper case."""
    result = ""
    for c in s:
        result += c.lower() if c.isupper() else c.upper()
    return result


@inputs(("ab", 2), ("", 3), ("abc", 1), ("x", 0), ("hi", 3), ("a b", 2))
def repeat_chars(s, n):
    """Return s with every character repeated n times ('ab', 2 -> 'aabb')."""
    return "".join(c * n for c in s)


@inputs(("hello", 4), ("hello", 5), ("hello", 10), ("", 0), ("abcdef", 3), ("abc", 0))
def truncate(s, n):
    """Return s if it has at most n characters, else its first n characters and '...'."""
    if len(s) <= n:
        return s
    return s[:n] + "..."


@inputs(("banana", "ana"), ("aaa", "aa"), ("abc", "d"), ("", "a"), ("abc", "abc"), ("ab", "abc"))
def count_substring(s, sub):
    """Return how many times sub occurs in s, overlaps included ('aaa', 'aa' -> 2)."""
    count = 0
    for i in range(len(s) - len(sub) + 1):
        if s[i : i + len(sub)] == sub:
            count += 1
    return count


@inputs(
    "", "Pack my box with five dozen liquor jugs", "abcdefghijklmnopqrstuvwxy", "hello", "z", "a"
)
def is_pangram(s):
    """Return True if s contains every letter from a to z, ignoring case."""
    for c in "abcdefghijklmnopqrstuvwxyz":
        if c not in s.lower():
            return False
    return True


@inputs("hello", "", "AEIOUaeiou", "rhythm", "Programming Language", "a")
def remove_vowels(s):
    """Return s without its vowels (a, e, i, o, u, lower or upper case)."""
    return "".join(c for c in s if c.lower() not in "aeiou")


@inputs("hello", "", "a", "abab", "mississippi", "aA")
def char_counts(s):
    """Return a dict mapping each character of s to the number of times it occurs in s."""
    counts = {}
    for c in s:
        counts[c] = counts.get(c, 0) + 1
    return counts


@inputs("007", "12a", "", "123", "0", "9", "a", "1/", "/", ":")
def is_digits(s):
    """Return True if s is not empty and all its characters are digits 0 to 9."""
    if s == "":
        return False
    for c in s:
        if c < "0" or c > "9":
            return False
    return True


@inputs("hello", "", "a", "ABCD", "ab cd", "xYz")
def alternate_case(s):
    """Return s with characters at even positions upper-cased and at odd positions lower-cased."""
    result = ""
    for i in range(len(s)):
        result += s[i].upper() if i % 2 == 0 else s[i].lower()
    return result


@inputs("abcd", "abc", "ab", "", "a", "hello", "python")
def middle(s):
    """Return the middle character of s if its length is odd, else the middle two ('' for '')."""
    mid = len(s) // 2
    if len(s) % 2 == 1:
        return s[mid]
    return s[mid - 1 : mid + 1]


@inputs("banana", "apple", "egg", "x", "string", "under", "cat")
def pig_latin(word):
    """Return word + 'way' if word starts with a vowel, else word[1:] + word[0] + 'ay'."""
    if word[0] in "aeiou":
        return word + "way"
    return word[1:] + word[0] + "ay"


@inputs(("a bb ccc", 1), ("a bb ccc", 2), ("", 0), ("hello world", 5), ("hello world", 4), ("x", 0))
def words_longer_than(s, n):
    """Return the space-separated words of s that have more than n characters, in order."""
    return [w for w in s.split() if len(w) > n]


@inputs("1234567890", "abcd", "abc", "", "abcde", "12345678")
def mask(s):
    """Return s with every character except the last four replaced by '#'."""
    return "#" * (len(s) - 4) + s[-4:]


@inputs("\n\n", "a\nb", "", "one", "a\n\nb\n", "x\ny\nz")
def count_lines(text):
    """Return the number of non-empty lines in text, lines being separated by newlines."""
    return len([line for line in text.split("\n") if line != ""])


@inputs("abab", "abcc", "hello", "abc", "", "a", "aa", "aab")
def has_double_letter(s):
    """Return True if some character of s is immediately followed by the same character."""
    for i in range(len(s) - 1):
        if s[i] == s[i + 1]:
            return True
    return False


@inputs("abba", "abca", "abcdef", "", "aa", "xyzzy", "abcb")
def first_repeated(s):
    """Return the first character of s that already occurred before it in s, or None."""
    seen = []
    for c in s:
        if c in seen:
            return c
        seen.append(c)
    return None


@inputs(
    ("abc", 5, "*"), ("7", 3, "0"), ("123", 3, "0"), ("", 2, "x"), ("long", 2, "-"), ("a", 1, "b")
)
def pad_left(s, width, fill):
    """Return s with the character fill added on its left until it has width characters."""
    return fill * (width - len(s)) + s


@inputs("abc123", "123", "", "abc", "a1 b2!", "!?")
def count_letters_digits(s):
    """Return the tuple (number of letters, number of digits) of the characters of s."""
    letters = sum(1 for c in s if c.isalpha())
    digits = sum(1 for c in s if c.isdigit())
    return (letters, digits)


@inputs("Abcdefg1", "PASSWORD", "Abcdef1", "Password1", "password1", "Pass1", "", "abcdefgh")
def is_strong_password(pw):
    """Return True if pw has at least 8 characters, a digit and an upper-case letter."""
    has_digit = any(c.isdigit() for c in pw)
    has_upper = any(c.isupper() for c in pw)
    return len(pw) >= 8 and has_digit and has_upper


@inputs(("abcde", 7), ("", 3), ("abcde", 2), ("abcde", 0), ("abcde", 5), ("ab", 1), ("x", 4))
def rotate_left(s, k):
    """Return s rotated left by k places ('abcde', 2 -> 'cdeab'); k may exceed len(s)."""
    if s == "":
        return s
    k = k % len(s)
    return s[k:] + s[:k]


@inputs(
    ("flow", "fl"), ("dog", "cat"), ("a", "ab"), ("", ""), ("abc", "abc"), ("a", ""), ("ab", "a")
)
def common_prefix(a, b):
    """Return the longest string that both a and b start with."""
    i = 0
    while i < len(a) and i < len(b) and a[i] == b[i]:
        i += 1
    return a[:i]


@inputs("get_user_id", "name", "", "a_b", "already_Camel", "x_y_z")
def snake_to_camel(name):
    """Return the snake_case name in camelCase ('get_user_id' -> 'getUserId')."""
    words = name.split("_")
    return words[0] + "".join(w.capitalize() for w in words[1:])


@inputs("getUserId", "name", "", "aB", "xYZ", "Start")
def camel_to_snake(name):
    """Return name with an underscore put before each upper-case letter, all in lower case."""
    result = ""
    for c in name:
        if c.isupper():
            result += "_"
        result += c.lower()
    return result


@inputs("Aa", "abc", "", "hello", "Dermatoglyphics", "ab1", "abca")
def is_isogram(s):
    """Return True if no character occurs more than once in s, ignoring upper/lower case."""
    s = s.lower()
    return len(set(s)) == len(s)


@inputs(("banana", "a"), ("banana", "b"), ("", "a"), ("abc", "z"), ("aaa", "a"), ("xax", "x"))
def find_all(s, ch):
    """Return the list of the positions at which the character ch occurs in s."""
    return [i for i in range(len(s)) if s[i] == ch]


@inputs("aabbbcc", "abba", "", "a", "aab", "abbb", "abc", "aaaa")
def count_runs(s):
    """Return the number of runs of equal neighbouring characters in s ('aabccc' -> 3)."""
    count = 0
    for i in range(len(s)):
        if i == 0 or s[i] != s[i - 1]:
            count += 1
    return count


@inputs("a(b)c", ")(", "()", "(())", "(()", "", "())(", "((a)(b))", ")")
def is_balanced(s):
    """Return True if the parentheses '(' and ')' in s are balanced, ignoring other characters."""
    depth = 0
    for c in s:
        depth += 1 if c == "(" else -1 if c == ")" else 0
        if depth < 0:
            return False
    return depth == 0


@inputs("banana", "", "abc", "aaaa", "abcabc", "Aa")
def remove_repeats(s):
    """Return s keeping only the first occurrence of each character."""
    result = ""
    for c in s:
        if c not in result:
            result += c
    return result


@inputs("42", "0", "7", "100", "", "9876", "007")
def parse_number(s):
    """Return the value of the string s of decimal digits, computed digit by digit ('' -> 0)."""
    value = 0
    for c in s:
        value = value * 10 + (ord(c) - ord("0"))
    return value


@inputs(
    ("abc", "abd"), ("abc", "abc"), ("", ""), ("karolin", "kathrin"), ("1010", "0101"), ("ab", "ba")
)
def hamming_distance(a, b):
    """Return the number of positions at which the equally long strings a and b differ."""
    return sum(1 for i in range(len(a)) if a[i] != b[i])


@inputs("a b c", "", "hello", "one two", "  x  y ", "the end of it")
def reverse_words(s):
    """Return the whitespace-separated words of s in reverse order, joined by single spaces."""
    words = s.split()
    result = []
    for i in range(len(words) - 1, -1, -1):
        result.append(words[i])
    return " ".join(result)


@inputs(("abcd", "acbd"), ("ab", "aba"), ("abcd", "cdab"), ("", ""), ("a", "a"), ("abc", "cab"))
def is_rotation(a, b):
    """Return True if b is a rotation of a: b is as long as a and occurs in a + a."""
    return len(a) == len(b) and b in a + a


@inputs(".bashrc", "README", "a.txt", "archive.tar.gz", "", "file.", "x.py")
def file_extension(filename):
    """Return the part of filename after its last '.', or '' if it has no '.'."""
    dot = filename.rfind(".")
    if dot == -1:
        return ""
    return filename[dot + 1 :]


@inputs(("b", "bold"), ("p", ""), ("em", "x"), ("div", "a b"), ("h1", "Title"), ("i", "<b>"))
def wrap_in_tag(tag, text):
    """Return text between the HTML tags <tag> and </tag>."""
    return "<" + tag + ">" + text + "</" + tag + ">"


@inputs("code", "a", "ab", "", "abc", "xyzw")
def swap_ends(s):
    """Return s with its first and last characters swapped (s itself if shorter than 2)."""
    if len(s) < 2:
        return s
    return s[-1] + s[1:-1] + s[0]


@inputs(("ace", "abcde"), ("", "abc"), ("aec", "abcde"), ("abc", ""), ("abc", "abc"), ("aa", "a"))
def is_subsequence(sub, s):
    """Return True if the characters of sub occur in s in the same order, not always adjacent."""
    i = 0
    for c in s:
        if i < len(sub) and sub[i] == c:
            i += 1
    return i == len(sub)


@inputs("swiss", "aabb", "", "abc", "aabbc", "x", "abab")
def first_unique(s):
    """Return the first character that occurs exactly once in s, or '' if there is none."""
    for c in s:
        if s.count(c) == 1:
            return c
    return ""


@inputs("1234567890", "0000000000", "5551234567", "9876543210", "1112223333", "0123456789")
def format_phone(digits):
    """Return the 10-digit string digits as '(123) 456-7890'."""
    return "(" + digits[:3] + ") " + digits[3:6] + "-" + digits[6:]


@inputs("Hello, world!", "", "...", "no punctuation", "Why? Because!", "a,b.c")
def strip_punctuation(s):
    """Return s without the characters '.', ',', '!' and '?'."""
    return "".join(c for c in s if c not in ".,!?")


@inputs("a1b2c3", "", "abc", "999", "x0y", "10 apples")
def sum_digit_chars(s):
    """Return the sum of the digits 0 to 9 found in s, other characters ignored."""
    return sum(int(c) for c in s if c.isdigit())


@inputs(["x", "y"], ["x"], ["a", "b", "c"], [], ["one", "two", "three", "four"], ["", ""])
def join_and(words):
    """Return words joined by ', ', the last two by ' and ' (['a', 'b', 'c'] -> 'a, b and c')."""
    if len(words) <= 1:
        return "".join(words)
    return ", ".join(words[:-1]) + " and " + words[-1]


BASICS: tuple[Basic, ...] = tuple(v for v in dict(globals()).values() if isinstance(v, Basic))
